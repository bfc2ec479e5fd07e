"""Version 1 of Lamina's wire types. Evolution rules: see ``schemas/README.md``."""
