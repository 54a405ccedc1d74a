"""qpn.apps: what a user runs -- the `qpn` command (cli.py) and the MiniLM demo (demo.py).

The top of the import graph (docs/ARCHITECTURE.md): it may use every other part; nothing imports it.
"""
