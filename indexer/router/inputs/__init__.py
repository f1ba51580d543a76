"""The router's inputs: JSONL lines, the bulk API, the generated workload and PostgreSQL tables.
Each turns what it reads into documents and hands them to the source's appender; no input knows
the node streams.
"""
