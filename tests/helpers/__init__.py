"""Test helpers shared across test folders (tiny offline tokenizers and the like)."""
