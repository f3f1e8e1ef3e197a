"""Offline preprocessing: tokenizer training, sharded tokenization, shard verification."""
