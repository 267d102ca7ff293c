"""Train and eval: an instrumented module follows ``train()`` / ``eval()`` as its model does.

Tracing runs ``forward`` once, so every ``self.training`` it reads (``F.dropout(...,
training=self.training)``, torchvision's stochastic depth, GoogLeNet's auxiliary
outputs) is baked into the graph with the value it had then. Leaf modules
(``call_module`` nodes) read their own flag when they run; every other read is a
constant. So the graph belongs to one *mode signature*: the training flags of
every module of the model. Call tree::

    instrument(model) -> gm                 ModeFollower in gm.meta["fxdebug_modes"]
    gm(x) / gm.train(mode)                  DebugGraphModule calls follower.follow(gm)
      └─ ModeLink.current()                 the flags of every module of the model, as the
           │                                user left them: the model's own module, or
           │                                gm's copy of it (gm's root and its containers),
           │                                whichever was switched since the last call
           └─ another signature than the graph's:
                ├─ seen before: that graph again (code generated on first use)
                └─ new: rebuild(model) under those flags (trace + the same passes),
                   its attributes added to gm, its graph swapped in; a graph whose
                   code equals a cached one is that one

The records keep module paths as keys; a graph of another mode may have other keys
(GoogLeNet's ``aux1`` runs only in train mode). A mode whose graph cannot be
made (the model does not trace in it) raises on the call, naming the module and
the user's file:line (:class:`~fxdebug.TraceFailure`). Part-by-part models use :class:`ModeLink` alone: their copies of the
user's modules take the flags it resolves, and each part is specialised to them.
"""

from __future__ import annotations

import contextlib
import operator
import pickle
import weakref
from typing import Callable, Iterator

import torch
import torch.fx as fx

from ..errors import FxdebugError
from ..base import torch_compat
from .graph_module import MODES_META, DebugGraphModule

__all__ = ["ModeLink", "ModeFollower", "follow_mode", "follow_modes"]

_TRAINING = operator.attrgetter("training")
_MISSING = object()


def _flags(modules) -> tuple[bool, ...]:
    return tuple(map(_TRAINING, modules))


class HookWatch:
    """Which of the model's hook registries hold a hook, looked at again only after torch
    handed out a new hook handle somewhere (one integer read a call otherwise).

    The graph is made for the hooks there were: a traced-through module with
    forward hooks runs them from hook nodes, one with backward hooks runs whole
    (tracing/module_hooks.py); a hook registered later on a module that had
    none would not run. So hooks are part of the signature a graph is made for.

    >>> lin = torch.nn.Linear(1, 1)
    >>> watch = HookWatch([lin])
    >>> before = watch.current()
    >>> _ = lin.register_forward_hook(lambda *a: None)
    >>> before == watch.current()
    False
    """

    def __init__(self, modules) -> None:
        self.registries = [registry for module in modules
                           for registry in torch_compat.hook_registries(module)]
        self.registries += torch_compat.hook_registries(None)
        self.count = torch_compat.hook_registrations()
        self.state = tuple(map(bool, self.registries))

    def current(self) -> tuple[bool, ...]:
        count = torch_compat.hook_registrations()
        if count is None or count != self.count:  # a hook was registered somewhere
            self.count = count
            self.state = tuple(map(bool, self.registries))
        return self.state


class ModeLink:
    """The training flags of the user's modules (*sources*) and of fxdebug's copies of some of
    them (*mirrors*), reconciled on each call: whichever side was switched since the last call
    gives the flag (a copy's ``train()`` also for the modules below it that it does not
    hold), and both sides take it, as one model would.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> copy = torch.nn.Module()
    >>> link = ModeLink(list(model.named_modules()), [(0, copy)])
    >>> _ = model.eval(); link.current(), copy.training
    ((False, False), False)
    >>> _ = copy.train(); link.current(), model.training
    ((True, True), True)
    """

    def __init__(self, sources: list[tuple[str, torch.nn.Module]],
                 mirrors: list[tuple[int, torch.nn.Module]]) -> None:
        self.paths = [path for path, _ in sources]
        self.sources = [module for _, module in sources]
        self.flags = self.seen = _flags(self.sources)
        self.set_mirrors(mirrors)

    def set_mirrors(self, mirrors: list[tuple[int, torch.nn.Module]]) -> None:
        """Mirror these modules (they take the resolved flags now)."""
        self.mirror_of = [index for index, _ in mirrors]
        self.mirrors = [module for _, module in mirrors]
        # a copy's train(mode) recurses into its children; those the copy does not hold
        # (modules traced through, with nothing to call) take its flag from the model's side
        mirrored = set(self.mirror_of)
        self.covers = [[i for i, path in enumerate(self.paths) if i not in mirrored
                        and (not self.paths[index] or path.startswith(self.paths[index] + "."))]
                       for index in self.mirror_of]
        for index, module in mirrors:
            module.training = self.flags[index]
        self.seen_mirrors = _flags(self.mirrors)
        self._watch()

    def _watch(self) -> None:
        # both sides in one list, read in one pass per call: a module's flag can be set by
        # its own train()/eval() or plain assignment, neither of which tells anyone, so every
        # call reads them all (one C-level attribute read each)
        self.watched = self.sources + self.mirrors
        self.seen_all = self.seen + self.seen_mirrors

    def current(self) -> tuple[bool, ...]:
        """The flags every source module should run with now (mirrors updated to them)."""
        both = _flags(self.watched)
        if both == self.seen_all:
            return self.flags
        now, mirrored = both[:len(self.sources)], both[len(self.sources):]
        flags = [flag if flag != seen else previous
                 for flag, seen, previous in zip(now, self.seen, self.flags)]
        for position, index in enumerate(self.mirror_of):
            flag = mirrored[position]
            if flag == self.seen_mirrors[position]:
                continue  # this copy was not switched
            flags[index] = flag
            for inner in self.covers[position]:
                if now[inner] == self.seen[inner]:
                    flags[inner] = flag
        resolved = tuple(flags)
        # both sides hold the resolved flags: the next switch of either is seen as one
        for module, flag in zip(self.sources, resolved):
            if module.training != flag:
                module.training = flag
        for position, index in enumerate(self.mirror_of):
            if self.mirrors[position].training != resolved[index]:
                self.mirrors[position].training = resolved[index]
        self.seen = self.flags = resolved
        self.seen_mirrors = _flags(self.mirrors)
        self._watch()
        return resolved

    def detached(self) -> "ModeLink":
        """A copy without mirrors (they are bound again to the module that holds it)."""
        copied = object.__new__(ModeLink)
        copied.__dict__.update(self.__dict__)
        copied.mirror_of, copied.mirrors, copied.seen_mirrors, copied.covers = [], [], (), []
        copied._watch()
        return copied

    @contextlib.contextmanager
    def applied(self, flags: tuple[bool, ...]) -> Iterator[None]:
        """The sources hold ``flags`` inside (to trace under them), their own flags after."""
        changed = [(module, module.training) for module, flag in zip(self.sources, flags)
                   if module.training != flag]
        try:
            for module, old in changed:
                module.training = not old
            yield
        finally:
            for module, old in changed:
                module.training = old


class _Variant:
    """The graph of one mode signature and the ``gm.meta`` entries that go with it."""

    def __init__(self, graph: fx.Graph, meta: dict) -> None:
        self.graph, self.meta = graph, meta


# rebuild(model, gm) -> the model traced and instrumented by the pipeline that made gm
# (not recompiled), sharing what it should with gm (its recorder)
Rebuild = Callable[[torch.nn.Module, fx.GraphModule], fx.GraphModule]


class ModeFollower:
    """What makes a DebugGraphModule traced from ``model`` follow the model's modes.

    Kept in ``gm.meta["fxdebug_modes"]``; ``gm`` calls :meth:`follow` before every
    forward and after ``gm.train(mode)``. Copies and pickles keep the model and
    the rebuild function and rebuild the other modes' graphs when first needed.
    ``after_switch(gm)`` runs after a graph is swapped in (e.g. to update source
    locations of the captures).
    """

    def __init__(self, gm: fx.GraphModule, model: torch.nn.Module, rebuild: Rebuild,
                 after_switch: Callable[[fx.GraphModule], None] | None = None) -> None:
        self.model, self.rebuild, self.after_switch = model, rebuild, after_switch
        self.why_not_rebuilt = ""
        self.link = ModeLink(list(model.named_modules()), [])
        self.signature = self.link.flags
        self.hooks: HookWatch | None = HookWatch(self.link.sources)
        self.hook_state = self.hooks.state
        self._bound: weakref.ref | None = None
        self._variants: dict[tuple, _Variant] = {}
        self._bind(gm)

    # -- binding to the module it belongs to (again after a copy or pickle) --------------
    def _bind(self, gm: fx.GraphModule) -> None:
        index = {path: position for position, path in enumerate(self.link.paths)}
        mirrors = []
        for path, module in gm.named_modules():
            position = index.get(path)
            if position is not None and module is not self.link.sources[position]:
                mirrors.append((position, module))
        flags = self.link.flags
        self.link.flags = self.signature  # the graph gm runs: its copies hold its flags
        self.link.set_mirrors(mirrors)
        self.link.flags = flags
        self._variants.setdefault((self.signature, self.hook_state),
                                  _Variant(gm.graph, self._meta_of(gm)))
        self._bound = weakref.ref(gm)

    @staticmethod
    def _meta_of(gm: fx.GraphModule) -> dict:
        return {key: value for key, value in gm.meta.items() if key != MODES_META}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_bound"], state["_variants"] = None, {}  # graphs of other modes: rebuilt
        state["link"] = self.link.detached()  # gm's own modules: bound again on first use
        del state["hooks"]  # the copy's own modules' registries: watched again
        try:
            pickle.dumps(self.rebuild)
        except Exception as exc:  # noqa: BLE001 - a user pass that cannot be pickled
            state["rebuild"] = None
            state["why_not_rebuilt"] = (f"its passes could not be copied with it "
                                        f"({type(exc).__name__}: {exc})")
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        # a copy's modules may still be half built here (deepcopy, unpickling): their hook
        # registries are looked at on the first call, when they are whole
        self.hooks = None

    # -- following ------------------------------------------------------------------------
    def in_step(self) -> bool:
        """Whether no module was switched since the last call and gm runs that mode's graph:
        plain reads of the flags, which ``torch.compile`` traces (and guards on)."""
        link = self.link
        return (tuple(module.training for module in link.sources) == link.seen
                and tuple(module.training for module in link.mirrors) == link.seen_mirrors
                and link.flags == self.signature)

    # never a frame torch.compile compiles: where dynamo runs a caller eagerly (its recompile
    # limit reached for DebugGraphModule's code), this still runs as plain Python
    @torch.compiler.disable
    def follow(self, gm: fx.GraphModule) -> None:
        """Swap in the graph of the modes the model's modules are in now (traced if new)."""
        if self._bound is None or self._bound() is not gm:
            self._bind(gm)
        if self.hooks is None:
            self.hooks = HookWatch(self.link.sources)
        signature, hook_state = self.link.current(), self.hooks.current()
        if (signature is self.signature or signature == self.signature) and \
                (hook_state is self.hook_state or hook_state == self.hook_state):
            return
        variant = self._variants.get((signature, hook_state))
        if variant is None:
            variant = self._build(gm, signature, hook_state)
        self._use(gm, signature, hook_state, variant)

    def _build(self, gm: fx.GraphModule, signature: tuple[bool, ...],
               hook_state: tuple[bool, ...]) -> _Variant:
        if self.rebuild is None:
            raise FxdebugError(
                f"fxdebug cannot follow {type(self.model).__name__} into "
                f"{_describe(self.link, signature, self.signature) or 'its hooks as they are now'}"
                f": this instrumented module "
                f"was copied or unpickled, and {self.why_not_rebuilt}. Instrument the model "
                f"again in the mode it should run in.")
        with self.link.applied(signature):
            built = self.rebuild(self.model, gm)
        code = built.graph.python_code(root_module="self").src
        for known in dict.fromkeys(self._variants.values()):  # same code: that graph
            if known.graph.python_code(root_module="self").src == code and \
                    _same_targets(gm, known.graph, built):
                self._variants[signature, hook_state] = known
                return known
        _adopt(gm, built)
        variant = self._variants[signature, hook_state] = _Variant(built.graph,
                                                                   self._meta_of(built))
        return variant

    def _use(self, gm: fx.GraphModule, signature: tuple[bool, ...], hook_state: tuple[bool, ...],
             variant: _Variant) -> None:
        old = self._variants[self.signature, self.hook_state]
        for key in old.meta:
            gm.meta.pop(key, None)
        gm.meta.update(variant.meta)
        if not isinstance(gm, DebugGraphModule):
            gm.graph = variant.graph
        else:
            gm.use_graph(variant.graph)
        self.signature, self.hook_state = signature, hook_state
        self._bind(gm)  # containers the new graph added to gm are copies to keep in step
        if self.after_switch is not None:
            self.after_switch(gm)


def _describe(link: ModeLink, signature: tuple[bool, ...], baked: tuple[bool, ...]) -> str:
    changed = [f"{link.paths[i] or '(root)'} in {'train' if flag else 'eval'} mode"
               for i, (flag, old) in enumerate(zip(signature, baked)) if flag != old]
    return ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")


def _resolve(owner: torch.nn.Module, target: str):
    value: object = owner
    for part in target.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def _same_targets(gm: fx.GraphModule, graph: fx.Graph, built: fx.GraphModule) -> bool:
    """The attributes ``graph`` (gm's) reads are the ones ``built`` reads at the same names."""
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            mine, theirs = _resolve(gm, str(node.target)), _resolve(built, str(node.target))
            if theirs is not _MISSING and theirs is not mine:
                return False
    return True


def _adopt(gm: fx.GraphModule, built: fx.GraphModule) -> None:
    """Give ``gm`` what ``built``'s graph reads (submodules, parameters, constants), renaming
    a target gm holds something else at; the graph then runs on ``gm``."""
    for node in built.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        value, here = _resolve(built, target), _resolve(gm, target)
        if here is value:
            continue
        if here is not _MISSING:
            stem = target.replace(".", "_")
            count = 1
            while hasattr(gm, f"{stem}_mode{count}"):
                count += 1
            target = node.target = f"{stem}_mode{count}"
        _place(gm, target, value)


def _place(gm: torch.nn.Module, target: str, value) -> None:
    *prefix, name = target.split(".")
    owner = gm
    for part in prefix:
        child = getattr(owner, part, None)
        if child is None:
            child = torch.nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        owner.register_buffer(name, value)
    else:
        setattr(owner, name, value)


def follow_mode(gm: torch.nn.Module) -> torch.nn.Module:
    """Bring an instrumented module to the modes its model is in now; ``gm`` back.

    Calls do this themselves; code that reads ``gm.graph`` or ``gm.code`` after
    ``model.eval()`` without a call in between (``fxdebug.dump``) calls it first.

    >>> import torch, fxdebug
    >>> class Drop(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.nn.functional.dropout(x, 0.5, training=self.training)
    >>> model = Drop()
    >>> gm = fxdebug.instrument(model, capture="all")
    >>> "training = True" in gm.code
    True
    >>> _ = model.eval()
    >>> "training = False" in follow_mode(gm).code
    True
    """
    follower = getattr(gm, "meta", {}).get(MODES_META)
    if isinstance(follower, ModeFollower):
        follower.follow(gm)
    return gm


def follow_modes(gm: fx.GraphModule, model: torch.nn.Module, rebuild: Rebuild,
                 after_switch: Callable[[fx.GraphModule], None] | None = None) -> None:
    """Make ``gm`` (traced from ``model``, then rebuilt by ``rebuild``) follow the modes of
    ``model``'s modules and of its own (see :class:`ModeFollower`).

    >>> import torch, fxdebug
    >>> model = torch.nn.Sequential(torch.nn.Dropout(0.5))
    >>> gm = fxdebug.trace(model)
    >>> follow_modes(gm, model, lambda m, _: fxdebug.trace(m))
    >>> isinstance(gm.meta["fxdebug_modes"], ModeFollower)
    True
    """
    gm.meta[MODES_META] = ModeFollower(gm, model, rebuild, after_switch)
