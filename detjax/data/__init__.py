"""Data: byte tokenizer, built-in corpus, Grain pipelines, text -> ArrayRecord preparation."""
