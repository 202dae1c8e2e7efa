"""CLI sub-commands, one module each; every module has `register(app)`."""
