"""Which captured calls the harness continued, and so which chains the task's reward may train.

The gateway records every call it answers, but not every answer shaped the run the evaluator
scored: a title generator's reply is shown in a UI, a call whose client went away (an SDK timeout,
then a retry) was never read, a single call off to the side of the conversation was never built
on. Such chains are kept in the trajectory with their tokens and masks exactly as captured, but
marked ``trainable=False`` with a ``role`` saying why, and no reward is attached to them.

The algorithm, shared by both builders:

1. **Side requests.** A call a harness preset declares as a side request (``SideRequest.match``
   on its normalized request: no tools + a title-generator system prompt, a JSON-schema
   classifier, a memory-extraction sub-agent) is set aside; those calls form their own chains,
   role ``side_request:<name>``.
2. **Links: which answer the request sends back.** Every other call, in capture order, links to
   its parent by what its request carries, not by prefix length alone: (a) the gateway's recorded
   parent (a token-in continuation's ``prompt.parent``, so builder and gateway agree); else
   (b) the earlier call whose answer is the request's last assistant turn (its tool-call ids, else
   its text and calls: ``_echoes_calls``, ``proxy.continuation.same_turn``); else (c) the earlier
   call whose context its prompt continues (``prefix.boundary``), among the leaves (calls nothing
   continues yet): an exact extension beats a re-rendered one, a longer shared part wins, then the
   leaf whose sampled ids the prompt actually holds, then one whose client was still there; failing
   that a *sibling*, linked to the parent of a leaf (a retry of that leaf, or a fork next to it);
   otherwise it is a root. Roots with identical prompts are siblings too (a retried first call).
   Being continued and being mergeable are different questions: a link whose prompt does not
   extend the parent's context (``boundary`` is None: compaction, a truncated old tool output, an
   edited earlier message) still makes the parent continued, but starts a new chain.
3. **Siblings, resolved by what later prompts contain.** A leaf whose sibling was continued is not
   trainable (``client_gone`` if the journal says its client went away, else ``uncontinued``).
   Where no sibling was continued (a retried last call), the ones whose client went away are
   dropped; if more than one remains they are all quarantined (``ambiguous_sibling``): nothing
   tells which one the harness kept. A leaf whose client went away is never trainable: nobody read
   it. A call whose client went away but which a later prompt does continue is kept: the tokens
   outrank the note.
4. **Chains.** From each root, the chain follows the kept child with the most calls below it
   (ties: the earliest) among those whose prompt extends it; every other kept child starts a chain
   of its own (a fork, or a rewrite: ``Chain.start`` says why), and every dropped call is a chain of
   one. A root whose request repeats an earlier conversation's messages up to the first user
   message but not its history, or quotes an answer nothing continued (a summary), starts
   ``history_rewritten``.
5. **Roles.** The chain with the most calls (ties: most sampled tokens, then the earliest) is
   ``main``; other chains are ``branch`` (sub-agents, compactions, forks the harness continued) —
   except a standalone single call (a root nobody continued) while ``main`` has more than one
   call: ``uncontinued``, unless its answer text appears in a later request (a sub-agent's reply
   quoted in a tool result), or its request holds the answer of an earlier call nothing continued
   by tokens (a compaction summary carried into a fresh history; quoting answers that were
   continued is just history, which a late fork holds too).

Readers of journals written before the client-gone note see no note: "not gone".
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from polar_env.journal.format import CLIENT_GONE
from polar_env.proxy.continuation import same_turn
from polar_env.proxy.providers.base import id_suffix
from polar_env.records import AssistantMessage, CompletionRecord
from polar_env.trajectory.prefix import Prompt, boundary, continues_sampled

if TYPE_CHECKING:
    from polar_env.harnesses.spec import SideRequest

MAIN = "main"
BRANCH = "branch"
UNCONTINUED = "uncontinued"
AMBIGUOUS = "ambiguous_sibling"
SIDE_PREFIX = "side_request:"
TRAINABLE_ROLES = frozenset({MAIN, BRANCH})
REWRITTEN = "history_rewritten"  # the request's messages are not the parent's plus new ones
RERENDERED = "template_rerendered"  # same messages, but the template rendered earlier turns anew
_TOKEN_IN = "continuation: token-in"  # the gateway's note on a prompt it built on its parent's tokens
_MIN_LINK_BYTES = 16  # shorter answers ("done", a title) prove nothing by appearing in a later request


@functools.cache
def builtin_side_requests() -> tuple[SideRequest, ...]:
    """The side requests every built-in harness preset declares with a matcher."""
    from polar_env.harnesses import HARNESSES

    return tuple(s for spec in HARNESSES.values() for s in spec.side_requests if s.match is not None)


def side_request_of(record: CompletionRecord, requests: Sequence[SideRequest]) -> str | None:
    """The name of the side request ``record`` is, or None for a main-line call."""
    for request in requests:
        if request.match is not None and request.match.matches(record.provider_api, record.chat_request):
            return request.name or "side"
    return None


@dataclass(frozen=True, slots=True)
class Chain:
    """Calls in merge order, and what they are to the run."""

    records: list[CompletionRecord]
    role: str
    cuts: list[int] = field(default_factory=list)  # cuts[i]: where records[i+1]'s prompt stops repeating records[i]'s
    start: str | None = None  # REWRITTEN/RERENDERED: why a continued conversation starts a new chain here
    parent: int | None = None  # the seq whose answer the first call sent back (None for a root)

    @property
    def trainable(self) -> bool:
        return self.role in TRAINABLE_ROLES


@dataclass(eq=False, slots=True)
class _Node:
    record: CompletionRecord
    gone: bool
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)
    dropped: str | None = None  # the role of a call the harness did not continue
    cut: int | None = 0  # prefix.boundary against the parent's prompt (merging reuses it); None: a rewrite
    size: int = 1  # calls in its subtree
    start: str | None = None  # why its chain starts here (REWRITTEN, RERENDERED)


def _last_assistant(record: CompletionRecord) -> dict[str, Any] | None:
    """The request's last assistant turn: the answer it sends back (None in a fresh history)."""
    for message in reversed(record.chat_request.messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            return message
    return None


def _echoes_calls(echo: Mapping[str, Any], sampled: AssistantMessage) -> bool | None:
    """Do the echoed turn's tool-call ids name ``sampled``'s calls? None when either side has no
    usable ids (ids shorter than 8 characters prove nothing; providers show ``id_suffix`` forms)."""
    echoed = [c.get("id") for c in echo.get("tool_calls") or [] if isinstance(c, Mapping)]
    given = [i for i in echoed if isinstance(i, str) and i]
    mine = [(c.id, tail) for c in sampled.tool_calls if len(tail := id_suffix(c.id)) >= 8]
    if not given or not mine:
        return None
    return all(any(e == full or e.endswith(tail) for full, tail in mine) for e in given)


def _answered(echo: dict[str, Any], record: CompletionRecord) -> bool:
    """Is ``echo`` (a request's last assistant turn) ``record``'s answer sent back? Tool-call ids
    decide when both sides have them; else the text and calls (not an empty answer: that names
    nothing). Where several calls match, linking prefers the one whose context the prompt extends."""
    by_ids = _echoes_calls(echo, record.message)
    if by_ids is not None:
        return by_ids
    message = record.message
    return (bool(message.tool_calls) or bool((message.content or "").strip())) and same_turn(echo, message)


def _link(records: Sequence[CompletionRecord], eot: Collection[int], turn_start: Collection[int],
          packed: Mapping[int, Prompt]) -> list[_Node]:
    """Step 2: each call's parent (see the module docstring)."""
    nodes: list[_Node] = []
    by_seq: dict[int, _Node] = {}
    call_ids: dict[str, list[_Node]] = {}  # tool-call id and its provider-facing suffix → the call
    leaves: list[_Node] = []
    for record in records:
        node = _Node(record, CLIENT_GONE in record.notes)
        prompt = packed[record.seq]
        parent: _Node | None = None
        best: tuple[int, ...] = ()  # (linked, exact, cut, ...): best[2] is the winner's cut
        named = _gateway_parent(record, prompt, by_seq)
        echo = _last_assistant(record) if named is None else None
        answered = [] if echo is None else [n for n in _by_ids(echo, call_ids) or nodes if _answered(echo, n.record)]
        for other in [named] if named is not None else answered or leaves:
            tip = packed[other.record.seq]
            cut = boundary(tip, prompt, eot, turn_start)
            if cut is None and named is None and not answered:
                continue
            key = (int(cut is not None), int(cut == len(tip.ids)), cut or 0,
                   int(cut is not None and continues_sampled(other.record, record, cut, eot)), int(not other.gone))
            if key > best:
                parent, best = other, key
        if parent is None:  # a sibling of a leaf: it continues that leaf's parent
            for leaf in leaves:
                if leaf.parent is None:
                    continue
                up = packed[leaf.parent.record.seq]
                cut = boundary(up, prompt, eot, turn_start)
                if cut is not None and (key := (1, int(cut == len(up.ids)), cut, 0, 0)) > best:
                    parent, best = leaf.parent, key
        if parent is not None:
            node.parent = parent
            node.cut = best[2] if best[0] else None
            if node.cut is None:
                node.start = RERENDERED if _appends(parent.record, record) else REWRITTEN
            if parent in leaves:
                leaves.remove(parent)
            parent.children.append(node)
        leaves.append(node)
        nodes.append(node)
        by_seq[record.seq] = node
        for call in record.message.tool_calls:
            for name in {call.id, id_suffix(call.id)}:
                call_ids.setdefault(name, []).append(node)
    return nodes


def _by_ids(echo: dict[str, Any], call_ids: Mapping[str, list[_Node]]) -> list[_Node]:
    """The calls an echo's tool-call ids may name (raw, ``toolu_<suffix>``, ``<name>__<suffix>``)."""
    found: dict[int, _Node] = {}
    for call in echo.get("tool_calls") or []:
        given = call.get("id") if isinstance(call, Mapping) else None
        if isinstance(given, str) and given:
            for key in (given, given[-24:], given.rsplit("_", 1)[-1]):
                found.update((id(n), n) for n in call_ids.get(key, ()))
    return list(found.values())


def _gateway_parent(record: CompletionRecord, prompt: Prompt, by_seq: Mapping[int, _Node]) -> _Node | None:
    """The parent the gateway built a token-in prompt on (its journal reference), if recorded."""
    if prompt.ref is None or not any(n.startswith(_TOKEN_IN) for n in record.notes):
        return None
    parent = by_seq.get(prompt.ref[0])
    if parent is None or prompt.ref[1] != len(parent.record.prompt_ids) + len(parent.record.response_ids):
        return None
    return parent


def _appends(parent: CompletionRecord, record: CompletionRecord) -> bool:
    """Are ``record``'s request messages ``parent``'s plus new ones (the history not rewritten)?"""
    before = parent.chat_request.messages
    return record.chat_request.messages[: len(before)] == before


def _rewritten_root(node: _Node, earlier: Sequence[_Node], requests: _Requests) -> bool:
    """A root that restarts an earlier conversation on a rewritten history: it repeats, up to the
    first user message, the messages of an earlier call whose history went on from there (an
    assistant turn follows), or its request quotes the answer of an earlier call nothing continued
    (a summary carried over)."""
    messages = node.record.chat_request.messages
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    for other in earlier:
        theirs = other.record.chat_request.messages
        if (first_user is not None and theirs[: first_user + 1] == messages[: first_user + 1]
                and any(m.get("role") == "assistant" for m in theirs[first_user + 1:])):
            return True
        if not other.children and (quoted := _answer(other.record)) and quoted in requests.of(node.record):
            return True
    return False


def _resolve(group: Sequence[_Node]) -> int:
    """Step 3 for one set of siblings; returns how many were quarantined as ambiguous."""
    leaves = [n for n in group if not n.children]
    if len(group) < 2 or not leaves:
        return 0
    if len(leaves) < len(group):  # a sibling was continued: the leaves were not
        for n in leaves:
            n.dropped = CLIENT_GONE if n.gone else UNCONTINUED
        return 0
    alive = [n for n in leaves if not n.gone]
    if len(alive) > 1:
        for n in alive:
            n.dropped = AMBIGUOUS
        return len(alive)
    return 0


def _chains(nodes: Sequence[_Node]) -> list[list[_Node]]:
    """Step 4: linear chains over the resolved tree, ordered by their first call."""
    for node in reversed(nodes):  # children come after their parents
        node.size = 1 + sum(c.size for c in node.children)
    chains: list[list[_Node]] = []
    starts = [n for n in nodes if n.parent is None]
    while starts:
        node = starts.pop()
        if node.dropped is not None:
            chains.append([node])
            continue
        path = [node]
        while True:
            kept = [c for c in node.children if c.dropped is None and c.cut is not None]
            nxt = max(kept, key=lambda c: (c.size, -c.record.seq)) if kept else None
            starts.extend(c for c in node.children if c is not nxt)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        chains.append(path)
    return sorted(chains, key=lambda c: c[0].record.seq)


def _answer(record: CompletionRecord) -> bytes:
    """The answer's text as it would appear JSON-escaped inside a later request ("" if too short)."""
    text = (record.message.content or "").strip()
    data = orjson.dumps(text)[1:-1]
    return data if len(data) >= _MIN_LINK_BYTES else b""


class _Requests:
    """Each call's request messages as JSON bytes, serialised on first need."""

    def __init__(self) -> None:
        self._bytes: dict[int, bytes] = {}

    def of(self, record: CompletionRecord) -> bytes:
        data = self._bytes.get(record.seq)
        if data is None:
            data = self._bytes[record.seq] = orjson.dumps(record.chat_request.messages)
        return data


def _linked(record: CompletionRecord, others: Sequence[_Node], requests: _Requests) -> bool:
    """Does a later request quote this call's answer, or its request quote the answer of an
    earlier call nothing continued (a leaf)?"""
    answer = _answer(record)
    mine = requests.of(record)
    for other in others:
        if other.record.seq > record.seq:
            if answer and answer in requests.of(other.record):
                return True
        elif other.record.seq < record.seq and not other.children:
            earlier = _answer(other.record)
            if earlier and earlier in mine:
                return True
    return False


def _roles(chains: list[list[_Node]], nodes: Sequence[_Node]) -> list[str]:
    """Step 5."""
    kept = [i for i, c in enumerate(chains) if c[0].dropped is None]
    roles = [c[0].dropped or BRANCH for c in chains]
    if not kept:
        return roles
    main = max(kept, key=lambda i: (len(chains[i]), sum(len(n.record.response_ids) for n in chains[i]), -i))
    roles[main] = MAIN
    if len(chains[main]) > 1:
        requests = _Requests()
        for i in kept:
            chain = chains[i]
            alone = len(chain) == 1 and chain[0].parent is None and not chain[0].children  # nothing sent it back
            if i != main and alone and not _linked(chain[0].record, nodes, requests):
                roles[i] = UNCONTINUED
    return roles


@dataclass(slots=True)
class Lineage:
    """A session's chains with their roles, and what was quarantined."""

    chains: list[Chain]
    ambiguous: int = 0

    def role_of(self) -> dict[int, str]:
        """seq → role of the chain that holds it."""
        return {r.seq: chain.role for chain in self.chains for r in chain.records}

    def stats(self) -> dict[str, Any]:
        """Captured vs trainable sampled tokens, and per role of what is not trained, for
        ``Trajectory.metadata['stats']``."""
        captured = sum(len(r.response_ids) for c in self.chains for r in c.records)
        trainable = sum(len(r.response_ids) for c in self.chains if c.trainable for r in c.records)
        untrained: dict[str, dict[str, int]] = {}
        for chain in self.chains:
            if not chain.trainable:
                entry = untrained.setdefault(chain.role, {"calls": 0, "tokens": 0})
                entry["calls"] += len(chain.records)
                entry["tokens"] += sum(len(r.response_ids) for r in chain.records)
        return {"captured_tokens": captured, "trainable_tokens": trainable,
                "trainable_share": round(trainable / captured, 6) if captured else 0.0,
                "untrained": untrained, "ambiguous_siblings": self.ambiguous,
                "chain_starts": [{"seq": c.records[0].seq, "parent": c.parent, "reason": c.start}
                                 for c in self.chains if c.start is not None]}


def _chain(nodes: list[_Node], role: str) -> Chain:
    first = nodes[0]
    parent = first.parent.record.seq if first.parent is not None else None
    return Chain([n.record for n in nodes], role, [n.cut for n in nodes[1:] if n.cut is not None], first.start, parent)


def lineage(records: Sequence[CompletionRecord], eot: Collection[int], turn_start: Collection[int],
            packed: Mapping[int, Prompt], side_requests: Sequence[SideRequest] | None = None) -> Lineage:
    """The chains of ``records`` (ordered by seq) and their roles; see the module docstring.
    ``side_requests``: the matchers to apply (default: every built-in preset's)."""
    matchers = builtin_side_requests() if side_requests is None else side_requests
    side: dict[str, list[CompletionRecord]] = {}
    main_pool: list[CompletionRecord] = []
    for record in records:
        name = side_request_of(record, matchers) if matchers else None
        if name is None:
            main_pool.append(record)
        else:
            side.setdefault(name, []).append(record)
    nodes = _link(main_pool, eot, turn_start, packed)
    ambiguous = 0
    for node in nodes:
        ambiguous += _resolve(node.children)
    roots: dict[bytes, list[_Node]] = {}
    for node in nodes:
        if node.parent is None:
            roots.setdefault(packed[node.record.seq].packed, []).append(node)
    for group in roots.values():
        ambiguous += _resolve(group)
    requests = _Requests()
    for i, node in enumerate(nodes):
        if node.parent is not None or len(roots[packed[node.record.seq].packed]) > 1:  # linked, or a retried first call
            continue
        if _rewritten_root(node, nodes[:i], requests):
            node.start = REWRITTEN
    for node in nodes:
        if node.gone and not node.children and node.dropped is None:
            node.dropped = CLIENT_GONE  # nobody read it, and nothing continued it
    chains = _chains(nodes)
    roles = _roles(chains, nodes)
    out = [_chain(chain, role) for chain, role in zip(chains, roles, strict=True)]
    for name, calls in side.items():
        for chain in _chains(_link(calls, eot, turn_start, packed)):
            out.append(_chain(chain, SIDE_PREFIX + name))
    out.sort(key=lambda c: c.records[0].seq)
    return Lineage(out, ambiguous)
