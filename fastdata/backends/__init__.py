"""One module per backend, each a subclass of ``base.Loader``; ``fastdata.registry`` maps names to them."""
