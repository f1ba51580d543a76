"""A PostgreSQL table as the router's input: its description, the initial copy and the logical
replication stream (pgoutput), and its values as JSON.
"""
