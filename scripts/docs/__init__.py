"""Makers of the documentation's images (``python -m scripts.docs.screenshots --help``)."""
