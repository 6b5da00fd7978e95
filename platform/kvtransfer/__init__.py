"""KV transfer between pools (DESIGN.md section 5): the wire protocol and `KVHandle`
(`protocol`), exporters and importers (`base`, one module per backend), the block copies they
share (`blocks`), and the backends by name (`backends`). Importing the package loads none of them.
"""
