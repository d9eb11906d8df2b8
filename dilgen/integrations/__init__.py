"""Integrations with the frameworks dilgen's users train in. Import the one you use:

    import dilgen.integrations.transformers   # attn_implementation="dilgen" (dilgen[hf])
"""
