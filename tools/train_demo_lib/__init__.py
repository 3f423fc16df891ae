"""Helpers of tools/train_demo.py (trains the demo Qwen3-MoE; needs the reference venv).

corpus     the Python 3.11 documentation (python3.11-doc): HTML -> text, metadata, the split
tokenizer  byte-level BPE trained on the training split, the token streams
training   the model, the learning-rate schedule, batches, evaluation and expert-usage skew
plot       loss.png
"""
