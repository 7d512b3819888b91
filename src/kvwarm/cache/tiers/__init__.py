"""Where rows and chunks are stored: the tiers, built from a name or a URL by ``registry``."""
