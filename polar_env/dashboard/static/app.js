// polar-env dashboard: a small hash-routed page over the JSON API. Everything the agent wrote is
// put in the page with textContent (never innerHTML): transcripts are adversarial input.
"use strict";

const STAGES = ["queued", "init", "ready", "running", "postrun"];
const STAGE_COLORS = {queued: "#b8c1d1", init: "#f2b134", ready: "#8fc1e3", running: "#3157d5", postrun: "#2f9e57"};
const main = document.getElementById("main");
let liveSource = null;
let refreshTimer = null;  // the sessions table of a running job re-reads its page

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "style") el.style.cssText = v;
    else el.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined && c !== false)
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}
const enc = encodeURIComponent;
const put = (...children) => main.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
// Each route() bumps routeId; an answer that arrives after the user moved on is dropped (Stale),
// so a slow session page cannot overwrite the page Back returned to.
let routeId = 0;
class Stale extends Error {}
async function api(path) {
  const mine = routeId;
  const resp = await fetch(path, {credentials: "same-origin"});
  const body = resp.ok ? await resp.json() : `${resp.status} ${await resp.text()}`;
  if (mine !== routeId) throw new Stale(path);
  if (!resp.ok) throw new Error(body);
  return body;
}
const fmt = (v, digits = 3) => v === null || v === undefined ? "—" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v));
const fixed = (v, digits = 3) => v === null || v === undefined ? "—" : Number(v).toFixed(digits);
const pct = (v) => v === null || v === undefined ? "—" : (100 * v).toFixed(1) + "%";
const badge = (status) => h("span", {class: `badge ${status}`, text: status});
function crumbs(...parts) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(...parts.map(([text, href]) => href ? h("a", {href, text}) : h("span", {text})));
}
function stat(label, value, id) { return h("div", {class: "stat"}, h("b", {id, text: value}), h("span", {text: label})); }

// -- runs ----------------------------------------------------------------------------------
async function pageRuns() {
  crumbs(["runs"]);
  const {runs} = await api("/api/runs");
  const picked = new Set();
  const compareBtn = h("button", {id: "compare", disabled: true, onclick: () => {
    const [a, b] = [...picked]; location.hash = `#/compare/${enc(a)}/${enc(b)}`;
  }}, "Compare the two selected");
  const rows = runs.map((r) => {
    const box = h("input", {type: "checkbox", "data-pick": r.name, onclick: (ev) => {
      ev.stopPropagation();
      ev.target.checked ? picked.add(r.name) : picked.delete(r.name);
      compareBtn.disabled = picked.size !== 2;
    }});
    const passes = Object.entries(r.pass).filter(([k]) => k.startsWith("pass@"));
    return linkRow(`#/run/${enc(r.name)}`, {"data-run": r.name}, [
      h("td", {}, box), h("td", {}, h("a", {href: `#/run/${enc(r.name)}`}, h("b", {text: r.name})), h("div", {class: "muted", text: r.path})),
      h("td", {"data-col": "state", title: r.state_reason || ""}, badge(r.state), r.kind === "train" ? [" ", badge("train")] : null,
        r.resume && (r.state === "crashed" || r.state === "interrupted") ? h("div", {class: "muted resume", text: r.resume}) : null),
      h("td", {class: "num", text: r.sessions}),
      h("td", {text: Object.entries(r.statuses).map(([k, v]) => `${k} ${v}`).join(", ")}),
      h("td", {class: "num", text: fixed(r.mean_reward)}),
      h("td", {"data-col": "pass", text: passes.map(([k, v]) => `${k} ${fixed(v)}`).join("  ") + (r.pass_version ? ` (policy v${r.pass_version})` : "")}),
      h("td", {class: "num", text: r.wall_s === null || r.wall_s === undefined ? "—" : fmt(r.wall_s, 1) + " s"}),
      h("td", {class: "num", text: pct(r.engine_busy_fraction)})]);
  });
  put(
    h("h1", {text: "Runs"}),
    h("div", {class: "filters"}, compareBtn, h("span", {class: "muted", text: `${runs.length} run(s)`})),
    h("table", {id: "runs"},
      h("thead", {}, h("tr", {}, ...["", "run", "state", "sessions", "statuses", "mean reward", "pass@k", "wall", "engine busy"]
        .map((t) => h("th", {text: t})))),
      h("tbody", {}, rows)));
}

// (compare, health and curves: runviews.js)

// -- run: live and sessions ----------------------------------------------------------------
function runTabs(run, on) {
  return h("div", {class: "tabs"},
    h("a", {href: `#/run/${enc(run)}`, class: on === "live" ? "on" : "", text: "Live"}),
    h("a", {href: `#/run/${enc(run)}/tasks`, class: on === "tasks" ? "on" : "", text: "Tasks"}),
    h("a", {href: `#/run/${enc(run)}/sessions`, class: on === "sessions" ? "on" : "", text: "Sessions"}),
    h("a", {href: `#/run/${enc(run)}/curves`, class: on === "curves" ? "on" : "", text: "Curves"}),
    h("a", {href: `#/run/${enc(run)}/health`, class: on === "health" ? "on" : "", text: "Health"}));
}

function timeline(history, nowS) {
  const W = 900, H = 180, P = 28;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H + 24}`);
  svg.setAttribute("id", "timeline");
  svg.style.width = "100%";
  if (!history || history.length === 0) {
    const t = document.createElementNS(svg.namespaceURI, "text");
    t.setAttribute("x", P); t.setAttribute("y", H / 2); t.textContent = "no stage transitions yet";
    svg.append(t); return svg;
  }
  const t0 = history[0][0];  // a live job's history starts at its first progress tick
  // a running job's last state holds until now, not until its last change
  const tEnd = Math.max(history[history.length - 1][0] - t0, (nowS ?? 0) - t0, 1e-6);
  svg.setAttribute("data-t-end", (t0 + tEnd).toFixed(3)); svg.setAttribute("data-t-last", history[history.length - 1][0].toFixed(3));
  const totals = history.map(([, c]) => STAGES.reduce((s, k) => s + (c[k] || 0), 0));
  const yMax = Math.max(1, ...totals);
  const x = (t) => P + (W - P - 8) * ((t - t0) / tEnd), y = (v) => H - (H - 10) * (v / yMax);
  const base = history.map(() => 0);
  for (const stage of STAGES) {
    const top = history.map(([, c], i) => base[i] + (c[stage] || 0));
    let d = "";
    history.forEach(([t], i) => {  // step-post: hold each value until the next sample
      const tn = i + 1 < history.length ? history[i + 1][0] : t0 + tEnd;
      d += `${i === 0 ? "M" : "L"}${x(t)},${y(top[i])} L${x(tn)},${y(top[i])} `;
    });
    for (let i = history.length - 1; i >= 0; i--) {
      const tn = i + 1 < history.length ? history[i + 1][0] : t0 + tEnd;
      d += `L${x(tn)},${y(base[i])} L${x(history[i][0])},${y(base[i])} `;
    }
    const path = document.createElementNS(svg.namespaceURI, "path");
    path.setAttribute("d", d + "Z"); path.setAttribute("fill", STAGE_COLORS[stage]); path.setAttribute("data-stage", stage);
    svg.append(path);
    top.forEach((v, i) => { base[i] = v; });
  }
  const axis = (txt, ax, ay) => { const t = document.createElementNS(svg.namespaceURI, "text"); t.setAttribute("x", ax); t.setAttribute("y", ay); t.textContent = txt; svg.append(t); };
  axis(`${t0.toFixed(1)} s`, P, H + 16); axis(`${(t0 + tEnd).toFixed(1)} s`, W - 50, H + 16); axis(String(yMax), 2, 16); axis("0", 2, H);
  STAGES.forEach((s, i) => {
    const r = document.createElementNS(svg.namespaceURI, "rect");
    r.setAttribute("x", P + 110 + i * 90); r.setAttribute("y", H + 7); r.setAttribute("width", 10); r.setAttribute("height", 10); r.setAttribute("fill", STAGE_COLORS[s]);
    svg.append(r); axis(s, P + 124 + i * 90, H + 16);
  });
  return svg;
}

async function pageLive(run) {
  crumbs(["runs", "#/"], [run]);
  const stages = h("div", {class: "cards"}, STAGES.map((s) => h("div", {class: "stat", "data-stage": s},
    h("b", {text: "0"}), h("span", {text: s}))));
  const tl = h("div", {class: "card"}, h("h2", {text: "Stage occupancy"}), h("div", {id: "timeline-box"}));
  const state = h("span", {id: "live-state", class: "badge", text: "…"});
  const phase = h("p", {class: "muted", id: "live-phase"});
  const note = h("div", {class: "card", id: "live-note"});  // how a job that is not running ended, and its resume
  const flying = h("div", {class: "card", id: "in-flight"});
  put(h("h1", {}, `${run} `, state), runTabs(run, "live"), phase, note,
    h("div", {class: "cards"}, stat("sessions done", "0", "live-done"), stat("sessions", "0", "live-total"),
      stat("reward so far", "—", "live-reward"), stat("engine busy", "—", "live-busy"), stat("elapsed", "—", "live-elapsed")),
    stages, tl, flying);
  const render = (snap) => {
    document.getElementById("live-done").textContent = fmt(snap.done);
    document.getElementById("live-total").textContent = fmt(snap.total);
    document.getElementById("live-reward").textContent = fixed(snap.mean_reward);
    document.getElementById("live-busy").textContent = pct(snap.engine_busy);
    document.getElementById("live-elapsed").textContent = snap.elapsed_s === undefined ? "—" : `${snap.elapsed_s.toFixed(1)} s`;
    state.textContent = snap.state; state.className = `badge ${snap.state}`;
    for (const s of STAGES) stages.querySelector(`[data-stage="${s}"] b`).textContent = String((snap.stages || {})[s] || 0);
    document.getElementById("timeline-box").replaceChildren(timeline(snap.history, snap.now_s));
    phase.textContent = snap.state === "starting" && snap.phase ? `starting: ${snap.phase}` : "";
    const stopped = snap.state === "crashed" || snap.state === "interrupted";
    note.hidden = !stopped;
    note.className = `card${snap.state === "crashed" ? " bad" : ""}`;
    note.replaceChildren(h("b", {text: `${snap.state}: `}), snap.reason || "",
      snap.resume ? h("p", {}, "continue it with ", h("code", {id: "live-resume", text: snap.resume})) : null);
    const on = Object.entries(snap.in_flight || snap.last_in_flight || {}).sort();
    flying.hidden = on.length === 0;
    const where = snap.in_flight ? "Sessions on the nodes" : "Sessions on the nodes when the job stopped";
    flying.replaceChildren(h("h2", {text: `${where} (${on.length})`}), h("div", {class: "chips"}, on.slice(0, 200).map(([sid, st]) =>
      h("a", {class: "chip", href: `#/run/${enc(run)}/session/${enc(sid)}`, "data-session": sid, "data-stage": st},
        h("span", {class: "swatch", style: `background:${STAGE_COLORS[st] || "#999"}`}), `${sid} · ${st}`))));
  };
  render(await api(`/api/runs/${enc(run)}/live`));
  liveSource = new EventSource(`/api/runs/${enc(run)}/live/events`);
  liveSource.onmessage = (ev) => render(JSON.parse(ev.data));
}

const SESSION_COLUMNS = [["session_id", "session"], ["task_id", "task"], ["sample_index", "sample", "num"],
  ["harness", "harness"], ["status", "status"], ["failure_kind", "failure kind"], ["reason", "reason"], ["reward", "reward", "num"],
  ["mask", "mask"],
  ["calls", "calls", "num"], ["tokens", "tokens", "num"], ["drift", "drift", "num"], ["wall_s", "wall s", "num"]];

async function pageSessions(run, params) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], ["sessions"]);
  const q = new URLSearchParams(params);
  const FILTERS = ["q", "status", "harness", "reason", "failure_kind", "task"];
  const state = {sort: q.get("sort") || "session_id", desc: q.get("desc") === "1", offset: Number(q.get("offset") || 0), limit: 50};
  for (const k of FILTERS) state[k] = q.get(k) || "";
  // paging, sort and filters live in the URL: each change is a history entry (typing replaces
  // its own), so Back restores the previous view and a link reproduces it
  const remember = (replace) => {
    const p = new URLSearchParams();
    for (const k of FILTERS) if (state[k]) p.set(k, state[k]);
    if (state.sort !== "session_id") p.set("sort", state.sort);
    if (state.desc) p.set("desc", "1");
    if (state.offset) p.set("offset", state.offset);
    const hash = `#/run/${enc(run)}/sessions${String(p) ? "?" + p : ""}`;
    if (hash === location.hash) return;
    replace ? history.replaceState(null, "", hash) : history.pushState(null, "", hash);
    routed = location.hash;
  };
  const change = (replace) => { remember(replace); load(); };
  const hists = h("div", {class: "grid2", id: "why"});
  const search = h("input", {id: "filter", placeholder: "filter: session, task, reason", value: state.q});
  const statusSel = h("select", {id: "status-filter"}), harnessSel = h("select", {id: "harness-filter"});
  const table = h("table", {id: "sessions"});
  const info = h("span", {id: "page-info", class: "muted"});
  const prev = h("button", {id: "prev", onclick: () => { state.offset = Math.max(0, state.offset - state.limit); change(); }}, "‹ prev");
  const next = h("button", {id: "next", onclick: () => { state.offset += state.limit; change(); }}, "next ›");
  let timer = null;
  search.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(() => {
    const typing = Boolean(state.q);  // the first keystroke is a history entry; the next ones replace it
    state.q = search.value; state.offset = 0; change(typing); }, 200); });
  statusSel.addEventListener("change", () => { state.status = statusSel.value; state.offset = 0; change(); });
  harnessSel.addEventListener("change", () => { state.harness = harnessSel.value; state.offset = 0; change(); });
  const taskChip = state.task ? h("span", {class: "badge", id: "task-filter"}, `task ${state.task} `,
    h("a", {href: "#", text: "×", onclick: (ev) => { ev.preventDefault(); state.task = ""; state.offset = 0; taskChip.remove(); change(); }})) : null;
  put(h("h1", {text: run}), runTabs(run, "sessions"), hists,
    h("div", {class: "filters"}, search, statusSel, harnessSel, taskChip, prev, next, info), table);
  const fill = (sel, values, current, label) => {
    if (sel.dataset.values === values.join("\n")) return;  // a live refresh must not close an open menu
    sel.dataset.values = values.join("\n");
    sel.replaceChildren(h("option", {value: "", text: `all ${label}`}),
      ...values.map((v) => h("option", {value: v, text: v, selected: v === current})));
  };
  async function load() {
    const p = new URLSearchParams({q: state.q, status: state.status, harness: state.harness, sort: state.sort,
      desc: state.desc ? "1" : "0", offset: state.offset, limit: state.limit});
    for (const k of ["reason", "failure_kind", "task"]) if (state[k]) p.set(k, state[k]);
    const data = await api(`/api/runs/${enc(run)}/sessions?${p}`);
    const pick = (key) => (value) => { state[key] = value; state.offset = 0; change(); };
    hists.replaceChildren(histogram("hist-reason", "Reasons (the evaluator's)", data.reasons, state.reason, pick("reason")),
      histogram("hist-failure", "Failure kinds (- : completed)", data.failure_kinds, state.failure_kind, pick("failure_kind")));
    fill(statusSel, data.statuses, state.status, "statuses");
    fill(harnessSel, data.harnesses, state.harness, "harnesses");
    const head = h("tr", {}, SESSION_COLUMNS.map(([key, label, cls]) => h("th", {
      class: `sortable ${cls || ""} ${state.sort === key ? "sorted" : ""} ${state.sort === key && state.desc ? "desc" : ""}`,
      "data-sort": key, text: label,
      onclick: () => { state.desc = state.sort === key ? !state.desc : false; state.sort = key; state.offset = 0; change(); }})));
    const body = data.rows.map((r) => {
      const href = `#/run/${enc(run)}/session/${enc(r.session_id)}`;
      return linkRow(href, {"data-session": r.session_id}, SESSION_COLUMNS.map(([key, , cls]) => key === "status" ? h("td", {"data-col": key}, badge(r.status))
        : key === "session_id" ? cellLink(href, r.session_id, {"data-col": key})
        : h("td", {class: `${cls || ""}${key === "failure_kind" && r[key] ? " bad" : ""}`, "data-col": key,
          text: key === "reward" && r[key] !== null ? r[key].toFixed(2) : fmt(r[key], 2)})));
    });
    table.replaceChildren(h("thead", {}, head), h("tbody", {}, body));
    const end = Math.min(data.total, state.offset + data.rows.length);
    info.textContent = data.total ? `${state.offset + 1}–${end} of ${data.total}` : "no sessions";
    prev.disabled = state.offset === 0; next.disabled = end >= data.total;
    if (refreshTimer) clearTimeout(refreshTimer);
    if (!data.finished) refreshTimer = setTimeout(load, 3000);
  }
  await load();
}

// -- session -------------------------------------------------------------------------------
function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => typeof p === "string" ? p : (p.text ?? JSON.stringify(p))).join("\n");
  return JSON.stringify(content, null, 2);
}
function toolCalls(calls) {
  return (calls || []).map((c) => {
    const fn = c.function || c;
    return h("div", {class: "toolcall"}, h("b", {text: `→ ${fn.name}`}), h("pre", {text: fn.arguments}));
  });
}
function message(m) {
  const reasoning = m.reasoning_content || m.reasoning;
  return h("div", {class: "msg", "data-role": m.role},
    h("div", {class: "role", text: m.role + (m.tool_call_id ? ` (result of ${m.tool_call_id})` : "")}),
    reasoning ? h("details", {}, h("summary", {text: "reasoning"}), h("pre", {text: reasoning})) : null,
    contentText(m.content) ? h("pre", {text: contentText(m.content)}) : null, toolCalls(m.tool_calls));
}
function callCard(c) {
  const r = c.reply;
  return h("div", {class: `call-card ${c.new_chain && c.seq !== 0 ? "new-chain" : ""}`, "data-seq": c.seq},
    h("div", {class: "muted"}, `call ${c.seq} · ${c.provider_api} · ${c.prompt_tokens} prompt + ${c.sampled_tokens} sampled tokens · `,
      `engine ${c.engine_ms} ms of ${c.total_ms} ms · weights v${c.weight_version ?? "?"} · finish ${c.finish_reason}`,
      c.new_chain && c.seq !== 0 ? h("span", {class: "badge error", text: "new chain"}) : null),
    c.messages.map(message),
    h("div", {class: "reply"}, h("div", {class: "msg"}, h("div", {class: "role", text: "model reply"}),
      r.reasoning ? h("details", {open: true}, h("summary", {text: "reasoning"}), h("pre", {text: r.reasoning})) : null,
      r.content ? h("pre", {text: r.content}) : null, toolCalls(r.tool_calls))),
    c.notes && c.notes.length ? h("div", {class: "muted", text: "notes: " + c.notes.join("; ")}) : null);
}

function tokenShade(logprob) {
  // sampled tokens: green, darker the less likely the sample was (log scale, saturating at logprob -10)
  const light = 88 - 42 * Math.min(1, -logprob / 10);
  return `hsl(140, 55%, ${light.toFixed(1)}%)`;
}

function renderTokens(box, page) {
  const drift = page.drift.map((d) => [d.at, d.at + d.span, d]);
  const calls = new Map(page.calls.map((c) => [c.at, c]));
  const driftStarts = new Map(page.drift.map((d) => [d.at, d]));
  const frag = document.createDocumentFragment();
  page.tokens.forEach(([id, text, mask, logprob], j) => {
    const pos = page.offset + j;
    if (calls.has(pos)) frag.append(h("span", {class: "marker call", "data-call": calls.get(pos).seq, text: `call ${calls.get(pos).seq}`}));
    if (driftStarts.has(pos)) frag.append(h("span", {class: "marker drift", text: `drift (${driftStarts.get(pos).span})`}));
    const region = mask === null ? "prompt" : `m${mask}`;
    const inDrift = drift.some(([a, b]) => pos >= a && pos < b);
    const special = /^<\|[a-z_]+\|>$/.test(text);
    const shown = text === "" ? "�" : text;
    const el = h("span", {class: `tok ${region}${inDrift ? " drift" : ""}${special ? " special" : ""}`, "data-i": pos, "data-id": id,
      "data-mask": mask === null ? "" : mask,
      title: `#${pos} id ${id}` + (mask === null ? " · prompt" : mask ? ` · sampled · logprob ${logprob} (p ${Math.exp(logprob).toFixed(3)})` : " · harness/template (mask 0)"),
      style: mask === 1 ? `background:${tokenShade(logprob)}` : null}, shown);
    frag.append(el);
  });
  box.replaceChildren(frag);
}

async function traceView(run, sid, traces) {
  const box = h("div", {class: "tokens", id: "tokens"});
  const info = h("span", {class: "muted", id: "trace-info"});
  const sel = h("select", {id: "trace-select"}, traces.map((t) => h("option", {value: t.index,
    text: `chain ${t.index}: ${t.prompt_tokens} prompt + ${t.response_tokens} response (${t.sampled_tokens} sampled), ${t.calls ?? "?"} call(s)${t.drift ? `, ${t.drift} drift` : ""}${t.start ? `, starts: ${t.start}` : ""}${t.cut ? `, cut: ${t.cut}` : ""}`})));
  const state = {index: 0, offset: 0, limit: 2000, total: 0};
  let scrollToResponse = true;  // open where the model's tokens are, not at the system prompt
  const prev = h("button", {id: "tok-prev", onclick: () => { state.offset = Math.max(0, state.offset - state.limit); load(); }}, "‹");
  const next = h("button", {id: "tok-next", onclick: () => { state.offset += state.limit; load(); }}, "›");
  const jump = h("button", {id: "tok-response", onclick: () => {
    state.offset = Math.max(0, state.prompt - 200); scrollToResponse = true; load(); }}, "jump to response");
  sel.addEventListener("change", () => { state.index = Number(sel.value); state.offset = 0; scrollToResponse = true; load(); });
  async function load() {
    const page = await api(`/api/runs/${enc(run)}/sessions/${enc(sid)}/trace/${state.index}?offset=${state.offset}&limit=${state.limit}`);
    state.total = page.total; state.prompt = page.prompt_tokens; state.offset = page.offset;
    renderTokens(box, page);
    if (scrollToResponse) {  // after the page is in the document (layout exists)
      scrollToResponse = false;
      setTimeout(() => { const first = box.querySelector(".tok.m1, .tok.m0"); if (first) box.scrollTop = Math.max(0, first.offsetTop - 60); }, 0);
    }
    info.textContent = `tokens ${page.offset}–${page.offset + page.limit} of ${page.total} (prompt ${page.prompt_tokens}, ${page.all_calls} call(s))`;
    prev.disabled = page.offset === 0; next.disabled = page.offset + page.limit >= page.total;
  }
  const legend = h("div", {class: "legend"},
    h("span", {}, h("span", {class: "swatch", style: "background:var(--prompt)"}), "prompt (first call)"),
    h("span", {}, h("span", {class: "swatch", style: "background:var(--harness)"}), "harness/template tokens (mask 0)"),
    h("span", {}, h("span", {class: "swatch", style: `background:${tokenShade(0)}`}), "sampled (mask 1), p≈1"),
    h("span", {}, h("span", {class: "swatch", style: `background:${tokenShade(-10)}`}), "sampled, logprob ≤ −10"),
    h("span", {}, h("span", {class: "marker call", text: "call n"}), "a call's sampled tokens start"),
    h("span", {}, h("span", {class: "marker drift", text: "drift"}), "re-rendered differently from what was sampled"));
  const wrap = h("div", {class: "card", id: "trace"}, h("h2", {text: "Merged trace(s)"}),
    h("div", {class: "filters"}, sel, prev, next, jump, info), legend, box);
  if (traces.length) await load(); else box.textContent = "no trace (nothing was captured)";
  return wrap;
}

function evaluationView(ev) {
  // the tests, integrity and patch have their own cards; the rest, one value per line
  const shown = ["tests_status", "log_tail", "apply_logs", "dropped_paths", "graded_paths", "graded_patch", "swebench", "graded",
    "canaries", "tamper_evidence", "forged_lines", "tampered"];
  const rows = Object.entries(ev).filter(([k]) => !shown.includes(k));
  const parts = [h("h2", {text: "Evaluator report"}),
    h("table", {id: "evaluation"}, h("tbody", {}, rows.map(([k, v]) => h("tr", {}, h("th", {text: k}),
      h("td", {style: "white-space:pre-wrap", text: typeof v === "object" ? JSON.stringify(v) : String(v)})))))];
  if (Object.keys(ev).length) parts.push(h("details", {}, h("summary", {text: "the whole report (JSON)"}), h("pre", {class: "raw", text: JSON.stringify(ev, null, 1)})));
  if (ev.log_tail) parts.push(h("details", {}, h("summary", {text: "eval log tail"}), h("pre", {class: "raw", text: ev.log_tail})));
  return h("div", {class: "card"}, parts);
}

function stagesView(stageSeconds) {
  const total = Object.values(stageSeconds).reduce((a, b) => a + b, 0) || 1;
  return h("div", {class: "card"}, h("h2", {text: "Stage times"}),
    h("div", {class: "stagebar"}, Object.entries(stageSeconds).map(([s, v]) => h("div", {title: `${s} ${v.toFixed(3)} s`,
      style: `width:${(100 * v / total).toFixed(2)}%;background:${STAGE_COLORS[s] || "#999"}`}))),
    h("table", {id: "stages"}, h("tbody", {}, Object.entries(stageSeconds).map(([s, v]) => h("tr", {}, h("th", {text: s}), h("td", {class: "num", text: `${v.toFixed(3)} s`}))))));
}

async function pageSession(run, sid) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], ["sessions", `#/run/${enc(run)}/sessions`], [sid]);
  const d = await api(`/api/runs/${enc(run)}/sessions/${enc(sid)}`);
  const r = d.row;
  const group = r.group_id ? h("a", {id: "group-link", href: `#/run/${enc(run)}/group/${enc(r.group_id)}`, text: `group ${r.group_id}`}) : null;
  const transcript = h("div", {id: "transcript"});
  const more = h("button", {id: "more-calls"}, "more calls");
  let offset = 0;
  async function loadCalls() {
    const page = await api(`/api/runs/${enc(run)}/sessions/${enc(sid)}/transcript?offset=${offset}&limit=10`);
    transcript.append(...page.calls.map(callCard));
    offset += page.calls.length;
    more.hidden = offset >= page.total;
  }
  more.addEventListener("click", loadCalls);
  const facts = h("div", {class: "cards"}, stat("reward", r.reward === null ? "—" : r.reward.toFixed(2), "s-reward"), stat("calls", fmt(d.calls), "s-calls"),
    stat("sampled tokens", fmt(r.tokens), "s-tokens"), stat("chains", fmt(d.traces.length), "s-chains"),
    stat("drift", fmt(d.stats.drift_boundaries ?? r.drift), "s-drift"), stat("wall", r.wall_s === null ? "—" : `${fmt(r.wall_s, 2)} s`, "s-wall"));
  put(
    h("h1", {}, `${sid} `, badge(r.status), r.failure_kind ? h("span", {class: "badge error", text: r.failure_kind}) : null),
    h("p", {class: "muted"}, `task ${r.task_id} · sample ${fmt(r.sample_index)} · harness ${fmt(r.harness)} · node ${fmt(r.node_id)} · `,
      h("a", {href: `#/run/${enc(run)}/session/${enc(sid)}/journal`, id: "journal-link", text: "raw journal records"}),
      group ? " · " : null, group),
    siblingsView(run, sid, d.siblings),
    d.in_flight ? h("div", {class: "card", id: "in-flight-note", text: `in ${r.status} on ${fmt(r.node_id)}: the job is running and this session has no outcome yet (this page shows what it has captured so far)`}) : null,
    d.failure_detail ? h("div", {class: "card bad", id: "failure-detail", text: d.failure_detail}) : null,
    facts, h("div", {class: "grid2"}, trainerView(d.trainer), d.integrity ? integrityView(d.integrity) : null),
    testsView(d.tests), d.graded_patch === null || d.graded_patch === undefined ? null : diffView(d.graded_patch),
    h("div", {class: "grid2"}, d.grading ? pendingViews(d) : [evaluationView(d.evaluation), stagesView(d.stage_seconds)]),
    await traceView(run, sid, d.traces),
    h("div", {class: "card"}, h("h2", {text: "Transcript (what the harness sent, and each reply)"}), transcript, more));
  await loadCalls();
}

async function pageJournal(run, sid, params) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], [sid, `#/run/${enc(run)}/session/${enc(sid)}`], ["journal"]);
  const offset = Number(new URLSearchParams(params).get("offset") || 0);
  const page = await api(`/api/runs/${enc(run)}/sessions/${enc(sid)}/journal?offset=${offset}&limit=3`);
  const link = (o, text, on) => h("a", {href: `#/run/${enc(run)}/session/${enc(sid)}/journal?offset=${o}`, text, style: on ? "" : "visibility:hidden"});
  put(h("h1", {text: `Journal of ${sid}`}),
    h("div", {class: "pager"}, link(Math.max(0, offset - 3), "‹ prev", offset > 0),
      h("span", {class: "muted", text: `records ${offset}–${offset + page.records.length} of ${page.total}`}),
      link(offset + 3, "next ›", offset + 3 < page.total)),
    ...page.records.map((rec) => h("div", {class: "card"}, h("h2", {text: `record seq ${rec.seq}`}),
      h("pre", {class: "raw", "data-seq": rec.seq, text: JSON.stringify(rec, null, 1)}))));
}

// -- routing -------------------------------------------------------------------------------
let routed = null;  // the hash last rendered (Back fires popstate and hashchange: render once)
async function route() {
  if (location.hash === routed) return;
  routed = location.hash;
  const mine = ++routeId;
  if (liveSource) { liveSource.close(); liveSource = null; }
  if (refreshTimer) { clearTimeout(refreshTimer); refreshTimer = null; }
  const [path, params] = (location.hash.slice(1) || "/").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  try {
    if (parts.length === 0) await pageRuns();
    else if (parts[0] === "compare") await pageCompare(parts[1], parts[2]);
    else if (parts[0] === "run" && parts.length === 2) await pageLive(parts[1]);
    else if (parts[0] === "run" && parts[2] === "sessions") await pageSessions(parts[1], params || "");
    else if (parts[0] === "run" && parts[2] === "tasks") await pageTasks(parts[1], params || "");
    else if (parts[0] === "run" && parts[2] === "health") await pageHealth(parts[1]);
    else if (parts[0] === "run" && parts[2] === "curves") await pageCurves(parts[1]);
    else if (parts[0] === "run" && parts[2] === "group") await pageGroup(parts[1], parts[3]);
    else if (parts[0] === "run" && parts[2] === "session" && parts[4] === "journal") await pageJournal(parts[1], parts[3], params || "");
    else if (parts[0] === "run" && parts[2] === "session") await pageSession(parts[1], parts[3]);
    else put(h("p", {text: "unknown page"}));
  } catch (err) {
    if (err instanceof Stale || mine !== routeId) return;  // the user has moved on: leave their page alone
    put(h("div", {class: "card bad", id: "error", text: String(err)}));
  }
  if (mine === routeId) document.body.dataset.ready = location.hash || "#/";
}
window.addEventListener("hashchange", route);
window.addEventListener("popstate", route);
// a stale answer to a click's or timer's request (not awaited by route) is not an error either
window.addEventListener("unhandledrejection", (ev) => { if (ev.reason instanceof Stale) ev.preventDefault(); });
route();
