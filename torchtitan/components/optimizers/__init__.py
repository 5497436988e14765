"""Optimizers beyond torch's own, one file per method (torch's AdamW/Adam are built in ../optimizer.py)."""
