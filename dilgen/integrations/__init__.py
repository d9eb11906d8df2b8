"""Integrations with the frameworks dilgen's users train in. Import the one you use:

    import dilgen.integrations.transformers   # attn_implementation="dilgen" (dilgen[hf])
    from dilgen.integrations.context_parallel import context_parallel   # that model over P GPUs
"""
