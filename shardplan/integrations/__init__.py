"""Ways into shardplan from other training frameworks; each imports its framework only inside itself.

hf_trainer.py   ShardplanTrainer: Hugging Face `transformers.Trainer` training a Program
"""
