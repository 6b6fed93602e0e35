"""kvtier's integration with vLLM: the KV connector, server launching and version shims.

This is the only package that imports vLLM.
"""
