"""One module per ``fxdebug`` subcommand; each defines ``register(subparsers)``.

``register`` adds its parser and sets ``run=function(args) -> int`` as a default.
"""
