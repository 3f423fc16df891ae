"""Helpers of tools/make_fixtures.py (tiny random MoE checkpoints + transformers references).

tokenizer   the byte-level BPE every fixture shares, trained on a built-in corpus
specs       one spec per fixture: architecture, seed, checkpoint layout, config
reference   model construction (config, random init) and the reference run with its margins
checkpoint  fp8 block quantisation, the published state dict and its layouts, config dialects
verify      both config dialects load to the same model and reproduce the reference
"""
