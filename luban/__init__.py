"""luban: train large language models, plan their layouts, and share a cluster to run them."""

__version__ = "0.1.0"
