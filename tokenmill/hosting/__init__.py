"""The models a server hosts: their specs (arguments or a models file), and the pool that loads and unloads
their engines under a memory budget."""
