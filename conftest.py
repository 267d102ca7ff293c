"""pytest, at the repository root: what not to collect under fxdebug/ (the doctests run there)."""

# What old pickles import: the module puts the function fxdebug.instrument in its own place in
# sys.modules, so pytest would find a function where it imported a module; nothing to collect.
collect_ignore = ["fxdebug/instrument.py"]
