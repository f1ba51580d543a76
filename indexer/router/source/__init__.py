"""The router's source: every version of every document on disk (the source log), the recent ones
in memory (the Mutation Manager), the append stage that writes both, and what each node can
read. Inputs write here; node streams read from here.
"""
