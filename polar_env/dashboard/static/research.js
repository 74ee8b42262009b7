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
async function pageTasks(run) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], ["tasks"]);
  const data = await api(`/api/runs/${enc(run)}/tasks`);
  const heads = ["task", "state", "harness", "model", "samples", "finished", "completed", "errored", "masked",
    "mean reward", "mean traces", "mean calls", "groups"];
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
  put(h("h1", {text: run}), runTabs(run, "tasks"),
    h("p", {class: "muted", text: `${data.tasks.length} task(s), model ${fmt(data.model)}. Mean reward over finished samples; errored: error, timeout or cancelled.`}),
    h("table", {id: "tasks"}, h("thead", {}, h("tr", {}, heads.map((t) => h("th", {text: t})))), h("tbody", {}, rows)));
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
