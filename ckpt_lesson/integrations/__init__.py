"""Our guarantees inside the trainers people already use (Lightning, Hugging Face).

Each module here imports its library only when *it* is imported:
``import ckpt_lesson`` never pulls in Lightning or transformers, and without
them installed these modules still import (constructing a plugin then says
what to install).
"""
