// polar-env dashboard: the researcher's views (tasks, a GRPO group, why sessions failed, what the
// evaluator ran, what the agent changed, what the trainer gets). Loaded before app.js, whose
// helpers (h, api, put, crumbs, ...) these functions call; like app.js, textContent only.
"use strict";

// A row that is also a real link: the first cell holds an <a>, so open-in-new-tab works; a plain
// click anywhere else on the row follows it too.
function linkRow(href, attrs, cells) {
  return h("tr", {...attrs, class: "link", onclick: (ev) => {
    if (ev.target.closest("a, input, button") || ev.ctrlKey || ev.metaKey || ev.shiftKey || ev.button !== 0) return;
    location.hash = href;
  }}, cells);
}
const cellLink = (href, text, attrs) => h("td", attrs || {}, h("a", {href, text}));

// -- tasks -----------------------------------------------------------------------------------
// Paged, filtered and sorted on the server like the Sessions view (1,250 tasks were 21,000
// elements); paging, sort and the filter are in the URL, so Back restores the view.
const TASK_COLUMNS = [["task_id", "task"], ["state", "state"], ["harness", "harness"], ["model", "model", "", false],
  ["samples", "samples", "num"], ["finished", "finished", "num"], ["completed", "completed", "num"], ["errored", "errored", "num"],
  ["masked", "masked", "num"], ["mean_reward", "mean reward", "num"], ["mean_traces", "mean traces", "num"],
  ["mean_calls", "mean calls", "num"], ["groups", "groups", "", false]];

async function pageTasks(run, params) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], ["tasks"]);
  const q = new URLSearchParams(params || "");
  const state = {q: q.get("q") || "", sort: q.get("sort") || "task_id", desc: q.get("desc") === "1", offset: Number(q.get("offset") || 0), limit: 50};
  const remember = (replace) => {
    const p = new URLSearchParams();
    if (state.q) p.set("q", state.q);
    if (state.sort !== "task_id") p.set("sort", state.sort);
    if (state.desc) p.set("desc", "1");
    if (state.offset) p.set("offset", state.offset);
    const hash = `#/run/${enc(run)}/tasks${String(p) ? "?" + p : ""}`;
    if (hash === location.hash) return;
    replace ? history.replaceState(null, "", hash) : history.pushState(null, "", hash);
    routed = location.hash;
  };
  const change = (replace) => { remember(replace); load(); };
  const search = h("input", {id: "task-search", placeholder: "filter: task id", value: state.q});
  const info = h("span", {id: "tasks-info", class: "muted"});
  const prev = h("button", {id: "tasks-prev", onclick: () => { state.offset = Math.max(0, state.offset - state.limit); change(); }}, "‹ prev");
  const next = h("button", {id: "tasks-next", onclick: () => { state.offset += state.limit; change(); }}, "next ›");
  const summary = h("p", {class: "muted", id: "tasks-summary"});
  const table = h("table", {id: "tasks"});
  let timer = null;
  search.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(() => {
    const typing = Boolean(state.q);
    state.q = search.value; state.offset = 0; change(typing); }, 200); });
  put(h("h1", {text: run}), runTabs(run, "tasks"), summary, h("div", {class: "filters"}, search, prev, next, info), table);
  async function load() {
    const p = new URLSearchParams({q: state.q, sort: state.sort, desc: state.desc ? "1" : "0", offset: state.offset, limit: state.limit});
    const data = await api(`/api/runs/${enc(run)}/tasks?${p}`);
    const all = Object.values(data.states).reduce((a, b) => a + b, 0);
    summary.textContent = `${all} task(s) (${Object.entries(data.states).map(([k, v]) => `${k} ${v}`).join(", ") || "none"}), model ${fmt(data.model)}. `
      + "Mean reward over finished samples; errored: error, timeout or cancelled.";
    const head = h("tr", {}, TASK_COLUMNS.map(([key, label, cls, sortable]) => sortable === false ? h("th", {class: cls || "", text: label})
      : h("th", {class: `sortable ${cls || ""} ${state.sort === key ? "sorted" : ""} ${state.sort === key && state.desc ? "desc" : ""}`,
        "data-sort": key, text: label,
        onclick: () => { state.desc = state.sort === key ? !state.desc : false; state.sort = key; state.offset = 0; change(); }})));
    const rows = data.tasks.map((t) => {
      const href = `#/run/${enc(run)}/sessions?task=${enc(t.task_id)}`;
      return linkRow(href, {"data-task": t.task_id}, [
        cellLink(href, t.task_id), h("td", {}, badge(t.state)), h("td", {text: fmt(t.harness)}), h("td", {text: fmt(t.model)}),
        h("td", {class: "num", text: t.samples}), h("td", {class: "num", text: t.finished}),
        h("td", {class: "num", "data-col": "completed", text: t.completed}), h("td", {class: "num", "data-col": "errored", text: t.errored}),
        h("td", {class: "num", text: t.masked}), h("td", {class: "num", "data-col": "mean_reward", text: fixed(t.mean_reward)}),
        h("td", {class: "num", text: fixed(t.mean_traces, 2)}), h("td", {class: "num", text: fixed(t.mean_calls, 2)}),
        h("td", {}, t.groups.map((g) => h("a", {class: "group-link", href: `#/run/${enc(run)}/group/${enc(g)}`, text: g})))]);
    });
    table.replaceChildren(h("thead", {}, head), h("tbody", {}, rows));
    const end = Math.min(data.total, state.offset + data.tasks.length);
    info.textContent = data.total ? `${state.offset + 1}–${end} of ${data.total}` : "no tasks";
    prev.disabled = state.offset === 0; next.disabled = end >= data.total;
  }
  await load();
}

// -- an in-flight session: what it has reached, instead of empty evaluator and stage cards ------
function pendingViews(d) {
  return [h("div", {class: "card", id: "grading-pending"}, h("h2", {text: "Evaluator report"}),
      h("p", {class: "muted", text: `grading ${d.grading}: the evaluator runs in POSTRUN, after the harness`})),
    h("div", {class: "card", id: "stages-reached"}, h("h2", {text: "Stages reached so far"}),
      h("div", {class: "chips"}, d.stages_reached.map((s, i) => h("span", {class: "chip", "data-stage": s},
        h("span", {class: "swatch", style: `background:${STAGE_COLORS[s] || "#999"}`}),
        i === d.stages_reached.length - 1 ? `${s} (now)` : s))),
      h("p", {class: "muted", text: "each stage's time comes with the session's outcome"}))];
}

// -- one GRPO group ------------------------------------------------------------------------------
async function pageGroup(run, group) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], ["tasks", `#/run/${enc(run)}/tasks`], [group]);
  const g = await api(`/api/runs/${enc(run)}/groups/${enc(group)}`);
  const step = (gid, text, id) => gid ? h("a", {id, href: `#/run/${enc(run)}/group/${enc(gid)}`, text}) : h("span", {id, class: "muted", text});
  const signed = (v) => v === null || v === undefined ? "—" : (v > 0 ? "+" : "") + v.toFixed(3);
  const cards = g.samples.map((s) => h("div", {class: `card sample${s.mask ? " masked" : ""}`, "data-session": s.session_id},
    h("h2", {}, h("a", {href: `#/run/${enc(run)}/session/${enc(s.session_id)}`, text: `sample ${fmt(s.sample_index)}`}), " ", badge(s.status)),
    h("table", {}, h("tbody", {},
      [["reward", fixed(s.reward, 2), "reward"], ["advantage", signed(s.advantage), "advantage"], ["mask", s.mask === null || s.mask === undefined ? "—" : String(s.mask), "mask"],
       ["failure kind", fmt(s.failure_kind), "failure_kind"], ["reason", fmt(s.reason), "reason"], ["calls", fmt(s.calls), "calls"],
       ["sampled tokens", fmt(s.tokens), "tokens"], ["trained tokens", fmt(s.trainable_tokens), "trainable_tokens"]]
        .map(([label, value, key]) => h("tr", {}, h("th", {text: label}), h("td", {"data-col": key, class: key === "advantage" && s.advantage ? (s.advantage > 0 ? "good" : "bad") : "", text: value})))))));
  put(h("h1", {text: `Group ${group}`}), runTabs(run, "tasks"),
    h("div", {class: "pager"}, step(g.prev, "‹ previous group", "group-prev"),
      h("span", {class: "muted", text: `group ${g.index + 1} of ${g.groups} · task ${fmt(g.task_id)} · mean reward ${fixed(g.mean_reward)} over ${g.counted} sample(s)`}),
      step(g.next, "next group ›", "group-next")),
    h("p", {class: "muted", id: "advantage-rule", text: `Advantage: ${g.advantage_rule} (no division by the spread); a masked sample has none, the trainer drops it.`}),
    h("div", {class: "samples", id: "samples"}, cards));
}

// -- why: the run's reasons and failure kinds as clickable bars ----------------------------------
function histogram(id, title, hist, current, pick) {
  const counts = hist.bars;
  const most = Math.max(1, ...counts.map(([, n]) => n));
  return h("div", {class: "card hist", id},
    h("h2", {}, title, current ? h("button", {class: "clear", onclick: () => pick("")}, `clear “${current}”`) : null),
    counts.map(([value, n]) => h("div", {class: `bar${value === current ? " on" : ""}`, "data-value": value, title: `${n} session(s): ${value}`,
      onclick: () => pick(value === current ? "" : value)},
      h("span", {class: "label", text: value}), h("span", {class: "fill", style: `width:${(100 * n / most).toFixed(1)}%`}),
      h("span", {class: "n", text: n}))),
    hist.other_values ? h("p", {class: "muted", text: `and ${hist.other_values} more value(s) over ${hist.other_sessions} session(s): use the filter box`}) : null);
}

// -- the evaluator's verdict -----------------------------------------------------------------
function testsView(tests) {
  if (!tests.length) return null;
  const groups = {};
  for (const t of tests) { groups[t.group] = groups[t.group] || {success: 0, other: 0}; groups[t.group][t.result === "success" ? "success" : "other"] += 1; }
  return h("div", {class: "card"}, h("h2", {text: "Tests (the evaluator's FAIL_TO_PASS / PASS_TO_PASS)"}),
    h("p", {class: "muted", text: Object.entries(groups).map(([g, c]) => `${g}: ${c.success} passed, ${c.other} not`).join(" · ")}),
    h("table", {id: "tests"}, h("thead", {}, h("tr", {}, h("th", {text: "group"}), h("th", {text: "result"}), h("th", {text: "test"}))),
      h("tbody", {}, tests.map((t) => h("tr", {"data-group": t.group, "data-result": t.result, class: t.result === "success" ? "" : "failrow"},
        h("td", {text: t.group}), h("td", {class: t.result === "success" ? "good" : "bad", text: t.result === "success" ? "passed" : t.result}),
        h("td", {text: t.test}))))));
}

function integrityView(ig) {
  const tampered = ig.tampered || (ig.tamper_evidence || []).length > 0 || ig.forged_lines > 0 || (ig.failed_canaries || []).length > 0;
  return h("div", {class: `card${tampered ? " alarm" : ""}`, id: "integrity"}, h("h2", {text: "Integrity"}),
    h("p", {id: "tamper-verdict", class: tampered ? "bad" : "good",
      text: tampered ? "TAMPERING SUSPECTED: the grade is not to be trusted" : `no tampering found${ig.canaries ? ` (${ig.canaries} canaries as expected)` : ""}`}),
    (ig.tamper_evidence || []).length ? h("ul", {id: "tamper-evidence"}, ig.tamper_evidence.map((e) => h("li", {text: typeof e === "string" ? e : JSON.stringify(e)}))) : null,
    ig.forged_lines ? h("p", {class: "bad", text: `${ig.forged_lines} forged result line(s)`}) : null,
    (ig.failed_canaries || []).map((c) => h("p", {class: "bad", text: `canary ${c.test}: expected ${c.expected}, got ${c.got}`})),
    h("p", {class: "muted", text: `graded paths: ${(ig.graded_paths || []).join(", ") || "—"}`}),
    ig.dropped_paths.length ? h("div", {class: "dropped", id: "dropped"}, h("b", {text: `${ig.dropped_paths.length} dropped path(s): changed by the agent, not graded`}),
      h("table", {}, h("tbody", {}, ig.dropped_paths.map((d) => h("tr", {"data-path": d.path}, h("td", {class: "bad", text: d.path}), h("td", {class: "muted", text: fmt(d.rule)}))))))
      : h("p", {class: "muted", text: "no dropped paths"}));
}

function diffView(patch) {
  if (!patch) return h("div", {class: "card", id: "diff-box"}, h("h2", {text: "What the agent changed"}), h("p", {class: "muted", text: "nothing: the graded patch is empty"}));
  const kind = (line) => line.startsWith("+++") || line.startsWith("---") || line.startsWith("diff ") || line.startsWith("index ") ? "meta"
    : line.startsWith("@@") ? "hunk" : line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "ctx";
  const lines = patch.replace(/\n$/, "").split("\n");
  const added = lines.filter((l) => kind(l) === "add").length, removed = lines.filter((l) => kind(l) === "del").length;
  return h("div", {class: "card", id: "diff-box"}, h("h2", {text: `What the agent changed (the graded patch: +${added} −${removed})`}),
    h("pre", {class: "diff", id: "diff"}, lines.map((l) => h("div", {class: `dl ${kind(l)}`, text: l || " "}))));
}

function trainerView(t) {
  return h("div", {class: "card", id: "trainer"}, h("h2", {text: "What the trainer gets"}),
    h("div", {class: "cards"}, stat("mask", t.mask === null ? "not yet known" : t.mask ? "dropped" : "kept", "t-mask"), stat("trained tokens", fmt(t.trained_tokens), "t-trained"),
      stat("reward", fixed(t.reward, 2), "t-reward")),
    h("p", {class: "muted", text: "mask true: the trainer drops the whole sample. Trained tokens: the sampled (mask 1) tokens of trainable traces; 0 when masked."}),
    h("table", {id: "trainer-traces"}, h("thead", {}, h("tr", {}, ["trace", "role", "trainable", "sampled tokens"].map((x) => h("th", {text: x})))),
      h("tbody", {}, t.traces.map((tr) => h("tr", {"data-trace": tr.index}, h("td", {text: tr.index}), h("td", {"data-col": "role", text: fmt(tr.role)}),
        h("td", {"data-col": "trainable", class: tr.trainable ? "good" : "bad", text: String(tr.trainable)}), h("td", {class: "num", text: tr.sampled_tokens}))))));
}

function siblingsView(run, sid, sibs) {
  if (sibs.length < 2) return null;
  const at = sibs.findIndex((s) => s.session_id === sid);
  const to = (i, text, id) => i >= 0 && i < sibs.length ? h("a", {id, href: `#/run/${enc(run)}/session/${enc(sibs[i].session_id)}`, text}) : h("span", {id, class: "muted", text});
  return h("div", {class: "pager", id: "siblings"}, to(at - 1, "‹ previous sample", "sib-prev"),
    sibs.map((s) => s.session_id === sid ? h("b", {text: `sample ${fmt(s.sample_index)} (${fixed(s.reward, 2)})`})
      : h("a", {href: `#/run/${enc(run)}/session/${enc(s.session_id)}`, text: `sample ${fmt(s.sample_index)} (${fixed(s.reward, 2)})`})),
    to(at + 1, "next sample ›", "sib-next"));
}
