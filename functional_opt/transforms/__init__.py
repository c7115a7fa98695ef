"""One module per family of gradient transformations."""
