"""qpn.apps: what a user runs -- the `qpn` command (cli.py), the MiniLM demo (demo.py) and the tiny
Llama that README.md's vLLM example serves (tiny_llama.py, `python -m qpn.apps.tiny_llama DIR`).

The top of the import graph (docs/ARCHITECTURE.md): it may use every other part; nothing imports it.
"""
