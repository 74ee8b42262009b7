// polar-env dashboard: a run's health (server, nodes, engine, limits, deaths), its curves (reward,
// pass rate, tokens/s and latency over time; per step for a train run) and the comparison of two
// runs. Loaded after research.js and before app.js; uses app.js's helpers at call time. SVG drawn
// here (nothing is fetched from anywhere but the dashboard); textContent only.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, text) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// A line chart: series [{name, color, points: [[x, y], ...]}]; y from 0 to yMax (or the data's max).
function lineChart(id, title, series, opts) {
  const W = 640, H = 200, L = 48, B = 28, T = 10, R = 10;
  const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H + 22}`, id, "data-points": series.map((s) => s.points.length).join(",")});
  svg.style.width = "100%";
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) { svg.append(svgEl("text", {x: L, y: H / 2}, "no points yet")); return h("div", {class: "card"}, h("h2", {text: title}), svg); }
  const xMin = Math.min(...pts.map((p) => p[0])), xMax = Math.max(...pts.map((p) => p[0]), xMin + 1e-6);
  const yMax = opts.yMax ?? Math.max(1e-6, ...pts.map((p) => p[1] ?? 0));
  svg.setAttribute("data-max", String(Math.max(...pts.map((p) => p[1] ?? 0))));  // the data's largest value
  const x = (v) => L + (W - L - R) * ((v - xMin) / (xMax - xMin || 1)), y = (v) => T + (H - T - B) * (1 - v / yMax);
  svg.append(svgEl("line", {x1: L, y1: y(0), x2: W - R, y2: y(0), stroke: "#c5cbd6"}), svgEl("line", {x1: L, y1: T, x2: L, y2: y(0), stroke: "#c5cbd6"}));
  svg.append(svgEl("text", {x: 2, y: T + 8}, fmt(yMax, 2)), svgEl("text", {x: 2, y: y(0)}, "0"),
    svgEl("text", {x: L, y: H - 8}, `${fmt(xMin, 1)}`), svgEl("text", {x: W - 80, y: H - 8}, `${fmt(xMax, 1)} ${opts.xUnit || ""}`),
    svgEl("text", {x: W / 2 - 40, y: H - 8}, opts.xLabel || ""));
  series.forEach((s, i) => {
    const good = s.points.filter((p) => p[1] !== null && p[1] !== undefined);
    if (good.length) {
      const d = good.map((p, j) => `${j ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
      // later series dashed: equal values (a pass rate equal to the mean reward) stay visible
      svg.append(svgEl("path", {d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-dasharray": i ? "6 4" : "none", "data-series": s.name}));
      for (const p of good) svg.append(svgEl("circle", {cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: 2.5, fill: s.color},));
    }
    svg.append(svgEl("rect", {x: L + 10 + i * 150, y: H + 8, width: 10, height: 10, fill: s.color}), svgEl("text", {x: L + 24 + i * 150, y: H + 17}, s.name));
  });
  return h("div", {class: "card"}, h("h2", {text: title}), svg);
}

// -- health ------------------------------------------------------------------------------------
async function pageHealth(run) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], ["health"]);
  const t = await api(`/api/runs/${enc(run)}/topology`);
  const limits = t.limits || {};
  const counts = (n, stage, limit) => `${(n.counts || {})[stage] ?? 0}${limit ? ` / ${limit}` : ""}`;
  const nodeRows = t.nodes.map((n) => h("tr", {"data-node": n.node_id, class: n.state === "dead" ? "failrow" : ""},
    h("td", {}, h("b", {text: n.node_id})), h("td", {"data-col": "state"}, badge(n.state)),
    h("td", {text: n.state === "dead" ? `dead: ${n.dead}` : `${fmt(n.host)} · pid ${fmt(n.pid)}${n.ip ? ` · ${n.ip}` : ""}`}),
    h("td", {class: "num", "data-col": "init", text: counts(n, "init", (n.limits || limits).max_init)}),
    h("td", {class: "num", "data-col": "ready", text: counts(n, "ready")}),
    h("td", {class: "num", "data-col": "running", text: counts(n, "running", (n.limits || limits).max_running)}),
    h("td", {class: "num", "data-col": "postrun", text: counts(n, "postrun", (n.limits || limits).max_postrun)}),
    h("td", {class: "num", "data-col": "active", text: fmt(n.active)}), h("td", {class: "num", "data-col": "completed", text: fmt(n.completed)}),
    h("td", {class: "num", "data-col": "in_flight", text: fmt(n.engine_in_flight)}), h("td", {class: "num", "data-col": "busy", text: pct(n.engine_busy_fraction)}),
    h("td", {class: "num", text: fmt(n.engine_calls)}), h("td", {class: `num${n.engine_errors ? " bad" : ""}`, text: fmt(n.engine_errors)}),
    h("td", {class: "num", text: fmt(n.sampled_tokens)}),
    h("td", {class: `num${n.node_lost ? " bad" : ""}`, "data-col": "node_lost", text: fmt(n.node_lost)}),
    h("td", {class: "muted", text: n.metrics_url ? `${n.metrics_url} (token: ${n.metrics_token_file})` : "—"})));
  // prefix-cache figures of a routed engine (engines/routing.py): per member, and one line per node
  const members = t.nodes.flatMap((n) => ((n.engine || {}).members || []).map((m) => ({node: n.node_id, client: n.engine.client, router: n.engine.router,
    cache: (((n.engine.prefix_cache || {}).servers) || {})[m.url] || {}, ...m})));
  const caches = t.nodes.filter((n) => (n.engine || {}).prefix_cache).map((n) => [n.node_id, n.engine.prefix_cache]);
  const engine = h("div", {class: "card", id: "engine"}, h("h2", {text: "Engine"}),
    h("p", {text: `${t.engine.kind}${t.engine.model ? `, model ${t.engine.model}` : ""}${t.engine.urls.length ? ` at ${t.engine.urls.join(", ")}` : " (in each node's process)"}`}),
    ...caches.map(([node, c]) => h("p", {class: "prefix-cache", "data-node": node, text: `prefix cache (${node}): ${pct(c.hit_rate)} of prompt tokens, ` +
      `${pct(c.warm_hit_rate)} after each session's first call, lowest server ${pct(c.min_server_hit_rate)}; ${fmt(c.spills)} spill(s) off an overloaded server`})),
    members.length ? h("table", {id: "engine-members"}, h("thead", {}, h("tr", {}, ["node", "client", "member", "up", "sessions", "in flight", "cache hit rate", "engine's own", "error"].map((x) => h("th", {text: x})))),
      h("tbody", {}, members.map((m) => h("tr", {"data-url": m.url}, h("td", {text: m.node}), h("td", {text: `${m.client}${m.router ? ` via router ${m.router}` : ""}`}),
        h("td", {text: m.url}), h("td", {class: m.up === false ? "bad" : "", text: m.up === undefined ? "—" : String(m.up)}),
        h("td", {class: "num", text: fmt(m.sessions ?? m.cache.sessions)}), h("td", {class: "num", text: fmt(m.cache.in_flight)}),
        h("td", {class: "num", "data-col": "hit_rate", text: pct(m.cache.hit_rate)}), h("td", {class: "num", text: pct(m.cache.engine_hit_rate)}),
        h("td", {class: "bad", text: m.error || ""})))))
      : h("p", {class: "muted", text: "no separate engine servers: each node runs its engine in its own process"}));
  const dead = t.dead_nodes.length || t.node_lost
    ? h("div", {class: "card alarm", id: "node-deaths"}, h("b", {text: `${t.dead_nodes.length} dead node(s)${t.dead_nodes.length ? ": " + t.dead_nodes.join(", ") : ""}; ${t.node_lost} session(s) lost with them (node_lost)`}),
      t.node_lost ? h("p", {}, h("a", {href: `#/run/${enc(run)}/sessions?failure_kind=node_lost`, text: "the lost sessions"})) : null) : null;
  const server = t.server ? h("div", {class: "card", id: "server"}, h("h2", {text: "Rollout server"}),
    h("p", {text: `${t.server.url} · ${t.server.tasks} task(s): ${Object.entries(t.server.states).map(([k, v]) => `${k} ${v}`).join(", ") || "none"}`})) : null;
  put(h("h1", {text: run}), runTabs(run, "health"),
    h("p", {class: "muted", id: "health-source", text: t.source ? `from ${t.source}${t.live ? " (live: refreshed every few seconds)" : ""}` : "no node stats recorded (a bare store)"}),
    dead, server,
    h("div", {class: "cards"}, stat("nodes", `${t.nodes.filter((n) => n.state === "alive").length} alive / ${t.nodes.length}`, "h-nodes"),
      stat("limits (init / running / postrun / ready buffer)", `${fmt(limits.max_init)} / ${fmt(limits.max_running)} / ${fmt(limits.max_postrun)} / ${fmt(limits.ready_buffer)}`, "h-limits"),
      stat("engine calls in flight", fmt(t.nodes.reduce((a, n) => a + (n.engine_in_flight || 0), 0)), "h-inflight")),
    h("div", {class: "card"}, h("h2", {text: "Nodes"}), h("table", {id: "nodes"},
      h("thead", {}, h("tr", {}, ["node", "state", "where", "init", "ready", "running", "postrun", "held", "done", "calls in flight", "engine busy",
        "engine calls", "errors", "sampled tokens", "node_lost", "/metrics"].map((x) => h("th", {text: x})))), h("tbody", {}, nodeRows))),
    engine);
  if (t.live) refreshTimer = setTimeout(() => { if (location.hash === `#/run/${enc(run)}/health`) { routed = null; route(); } }, 3000);
}

// -- curves ------------------------------------------------------------------------------------
async function pageCurves(run) {
  crumbs(["runs", "#/"], [run, `#/run/${enc(run)}`], ["curves"]);
  const c = await api(`/api/runs/${enc(run)}/curves`);
  const pts = c.points;
  const parts = [h("h1", {text: run}), runTabs(run, "curves")];
  if (c.trackers.length) parts.push(h("div", {class: "card", id: "trackers"}, h("h2", {text: "Tracker output"}),
    c.trackers.map((t) => h("p", {"data-tracker": t.kind}, h("b", {text: `${t.kind}: `}), h("code", {text: t.command}), h("span", {class: "muted", text: `  (${t.path})`})))));
  if (c.steps.length) parts.push(...await trainView(run));
  if (c.per_rollout.length) {
    parts.push(lineChart("curve-rollout", "Reward and pass rate per slime rollout id (slime's W&B step)",
      [{name: "mean reward", color: "#3157d5", points: c.per_rollout.map((r) => [r.rollout_id, r.mean_reward])},
       {name: "pass rate", color: "#2f9e57", points: c.per_rollout.map((r) => [r.rollout_id, r.pass_rate])}], {yMax: 1, xLabel: "rollout id"}),
    h("table", {id: "rollouts"}, h("thead", {}, h("tr", {}, ["rollout id", "sessions", "mean reward", "pass rate", "sampled tokens"].map((x) => h("th", {text: x})))),
      h("tbody", {}, c.per_rollout.map((r) => h("tr", {"data-rollout": r.rollout_id}, h("td", {text: r.rollout_id}), h("td", {class: "num", text: r.sessions}),
        h("td", {class: "num", "data-col": "reward", text: fixed(r.mean_reward)}), h("td", {class: "num", text: pct(r.pass_rate)}), h("td", {class: "num", text: fmt(r.sampled_tokens)}))))));
  }
  if (!c.steps.length) {  // a train run's sessions record no tokens and pool its policies: its curves are per step
    parts.push(h("div", {class: "grid2"},
      lineChart("curve-reward", "Reward and pass rate over time (running mean over finished sessions)",
        [{name: "mean reward", color: "#3157d5", points: pts.map((p) => [p.t, p.mean_reward])},
         {name: "pass rate", color: "#2f9e57", points: pts.map((p) => [p.t, p.pass_rate])}], {yMax: 1, xLabel: "seconds since start", xUnit: "s"}),
      lineChart("curve-tps", "Sampled tokens/s (cumulative)", [{name: "tokens/s", color: "#d9480f", points: pts.filter((p) => p.tokens_per_s !== null).map((p) => [p.t, p.tokens_per_s])}],
        {xLabel: "seconds since start", xUnit: "s"})),
      h("div", {class: "grid2"}, lineChart("curve-latency", `Session latency (wall s as each finished; mean ${fixed(c.latency.mean_wall_s, 2)}, p50 ${fixed(c.latency.p50_wall_s, 2)}, max ${fixed(c.latency.max_wall_s, 2)})`,
        [{name: "wall s", color: "#6a2ca8", points: pts.map((p) => [p.t, p.wall_s])}], {xLabel: "seconds since start", xUnit: "s"})));
  }
  put(...parts);
  if (c.live) refreshTimer = setTimeout(() => { if (location.hash === `#/run/${enc(run)}/curves`) { routed = null; route(); } }, 5000);
}

// A polar-env train run: per step its reward and sampled tokens/s, the held-out tasks before the
// first step and after the last, pass@k per policy version, and the steps table.
async function trainView(run) {
  const t = await api(`/api/runs/${enc(run)}/train`);
  const s = t.summary, ho = t.held_out, kKey = `pass@${t.ks[t.ks.length - 1]}`;
  const signed = (v) => v === null || v === undefined ? "—" : (v > 0 ? "+" : "") + v.toFixed(3);
  const out = [h("div", {class: "cards", id: "train-view"}, stat("training steps", fmt(s.steps ?? t.steps.length), "tr-steps"),
    stat("sampled tokens/s (rollout)", fmt(s.sampled_tokens_per_s, 1), "tr-tps"), stat("wall", s.wall_s === null || s.wall_s === undefined ? "—" : `${fmt(s.wall_s, 1)} s`, "tr-wall"),
    ho ? stat("held-out reward before → after", `${fixed(ho.before)} → ${fixed(ho.after)}`, "tr-held") : null),
  h("div", {class: "grid2"},
    lineChart("curve-step-reward", "Reward per training step", [{name: "mean reward", color: "#3157d5", points: t.steps.map((x) => [x.step, x.reward_mean])}], {yMax: 1, xLabel: "step"}),
    lineChart("curve-step-tps", "Sampled tokens/s per step (rollout)", [{name: "tokens/s", color: "#2f9e57", points: t.steps.map((x) => [x.step, x.tokens_per_s])}], {xLabel: "step"}))];
  if (ho) out.push(h("div", {class: "card", id: "held-out"}, h("h2", {text: `Held-out tasks (never trained on): before the first step and after the last (Δ ${signed(ho.gain)})`}),
    h("table", {}, h("thead", {}, h("tr", {}, ["task", "before", "after", "Δ"].map((x) => h("th", {text: x})))),
      h("tbody", {}, ho.per_task.map((r) => h("tr", {"data-task": r.task_id}, h("td", {text: r.task_id}),
        h("td", {class: "num", "data-col": "before", text: fixed(r.before)}), h("td", {class: "num", "data-col": "after", text: fixed(r.after)}),
        h("td", {class: "num", text: r.after === null ? "—" : signed(r.after - r.before)})))))));
  out.push(h("div", {class: "card"}, h("h2", {text: "pass@k per policy version (each step samples one policy; a task under one version is one group)"}),
    t.per_version.length ? h("table", {id: "pass-versions"}, h("thead", {}, h("tr", {}, ["policy version", "tasks", "sessions", "mean reward", "pass@1", kKey].map((x) => h("th", {text: x})))),
      h("tbody", {}, t.per_version.map((v) => h("tr", {"data-version": v.version}, h("td", {text: v.version}), h("td", {class: "num", text: v.tasks}),
        h("td", {class: "num", text: v.sessions}), h("td", {class: "num", text: fixed(v.mean_reward)}),
        h("td", {class: "num", "data-col": "pass@1", text: fixed(v["pass@1"])}), h("td", {class: "num", "data-col": "pass@k", text: fixed(v[kKey])})))))
      : h("p", {class: "muted", text: "no graded sessions in this run's store (source: local records no outcomes)"})));
  out.push(h("table", {id: "steps"}, h("thead", {}, h("tr", {}, ["step", "mean reward", "rollouts", "sampled tokens", "rollout s", "train s", "tokens/s", "loss"].map((x) => h("th", {text: x})))),
    h("tbody", {}, t.steps.map((x) => h("tr", {"data-step": x.step}, h("td", {text: x.step}), h("td", {class: "num", "data-col": "reward", text: fixed(x.reward_mean)}),
      h("td", {class: "num", text: fmt(x.rollouts)}), h("td", {class: "num", text: fmt(x.sampled_tokens)}), h("td", {class: "num", text: fixed(x.rollout_s, 2)}),
      h("td", {class: "num", text: fixed(x.train_s, 2)}), h("td", {class: "num", "data-col": "tps", text: fixed(x.tokens_per_s, 1)}), h("td", {class: "num", text: fixed(x.loss, 4)}))))));
  return out;
}

// -- compare -----------------------------------------------------------------------------------
async function pageCompare(a, b) {
  crumbs(["runs", "#/"], [`${a} vs ${b}`]);
  const data = await api(`/api/compare?a=${enc(a)}&b=${enc(b)}`);
  const ks = data.ks.map((k) => `pass@${k}`);
  const cell = (side, key) => side && side[key] !== undefined && side[key] !== null
    ? (key === "tasks" ? String(side[key]) : side[key].toFixed(3)) : "—";
  // the colour says whether the change is good, not its sign: better is +1 where more is good
  // (reward, pass@k, sessions that completed), -1 where less is (tokens, seconds, failures), 0 where unclear
  const delta = (x, y, key, digits = 3, better = 1) => {
    if (!x || !y || x[key] === null || y[key] === null || x[key] === undefined || y[key] === undefined) return h("td", {class: "num", "data-delta": key, text: ""});
    const d = y[key] - x[key];
    const verdict = d === 0 || better === 0 ? "neutral" : d * better > 0 ? "good" : "bad";
    return h("td", {class: `num delta ${verdict}`, "data-delta": key, "data-verdict": verdict, text: (d >= 0 ? "+" : "") + d.toFixed(digits)});
  };
  const sections = data.sections.map((s) => h("div", {class: "card"},
    h("h2", {text: {overall: "Overall", per_repo: "Per repo", per_harness: "Per harness"}[s.section]}),
    h("table", {"data-section": s.section},
      h("thead", {}, h("tr", {}, h("th", {text: s.section === "overall" ? "" : s.section.replace("per_", "")}),
        ...ks.flatMap((k) => [h("th", {class: "num", text: `${k} ${data.a}`}), h("th", {class: "num", text: `${k} ${data.b}`}), h("th", {class: "num", text: "Δ"})]),
        h("th", {class: "num", text: "tasks"}))),
      h("tbody", {}, s.rows.map((r) => h("tr", {"data-name": r.name, class: r.name.endsWith("shared tasks") ? "shared" : ""}, h("td", {text: r.name}),
        ...ks.flatMap((k) => [h("td", {class: "num", "data-cell": `${k}:a`, text: cell(r.a, k)}),
                              h("td", {class: "num", "data-cell": `${k}:b`, text: cell(r.b, k)}), delta(r.a, r.b, k)]),
        h("td", {class: "num", text: `${cell(r.a, "tasks")} / ${cell(r.b, "tasks")}`})))))));
  const ts = data.task_sets;
  const warning = ts.same ? null : h("div", {class: "card alarm", id: "task-set-warning"},
    h("b", {text: `The two runs graded different task sets (${ts.shared} shared; ${ts.only_a.length} only in ${data.a}, ${ts.only_b.length} only in ${data.b}): `
      + "the overall Δ compares different tasks. Read the \u201cshared tasks\u201d row and the per-task rows, or compare runs of the same tasks."}),
    ts.only_a.length ? h("p", {class: "muted", text: `only in ${data.a}: ${ts.only_a.slice(0, 20).join(", ")}${ts.only_a.length > 20 ? " …" : ""}`}) : null,
    ts.only_b.length ? h("p", {class: "muted", text: `only in ${data.b}: ${ts.only_b.slice(0, 20).join(", ")}${ts.only_b.length > 20 ? " …" : ""}`}) : null);
  const kinds = (side) => side ? Object.entries(side.failure_kinds).map(([k, n]) => `${k} ${n}`).join(", ") || "none" : "—";
  const drill = (run, task, side) => side ? h("a", {href: `#/run/${enc(run)}/sessions?task=${enc(task)}`, "data-drill": run, text: `${side.sessions} session(s)`}) : h("span", {class: "muted", text: "not run"});
  const taskBody = h("tbody", {});
  const taskInfo = h("span", {id: "compare-tasks-info", class: "muted"});
  const taskState = {offset: 0, limit: 50, q: ""};
  const taskRows = (page) => page.per_task.map((t) => h("tr", {"data-task": t.task_id, class: t.a && t.b ? "" : "muted"},
    h("td", {text: t.task_id}), h("td", {}, drill(data.a, t.task_id, t.a)), h("td", {}, drill(data.b, t.task_id, t.b)),
    h("td", {class: "num", "data-cell": "reward:a", text: t.a ? fixed(t.a.mean_reward) : "—"}), h("td", {class: "num", "data-cell": "reward:b", text: t.b ? fixed(t.b.mean_reward) : "—"}), delta(t.a, t.b, "mean_reward"),
    h("td", {class: "num", text: t.a ? fixed(t.a["pass@1"]) : "—"}), h("td", {class: "num", text: t.b ? fixed(t.b["pass@1"]) : "—"}), delta(t.a, t.b, "pass@1"),
    h("td", {"data-cell": "kinds:a", text: kinds(t.a)}), h("td", {"data-cell": "kinds:b", text: kinds(t.b)}),
    h("td", {class: "num", text: t.a ? fmt(t.a.mean_tokens, 1) : "—"}), h("td", {class: "num", text: t.b ? fmt(t.b.mean_tokens, 1) : "—"}), delta(t.a, t.b, "mean_tokens", 1, -1)));
  const showTasks = (page) => {  // one page of the per-task rows, paged on the server
    taskBody.replaceChildren(...taskRows(page));
    const end = Math.min(page.per_task_total, page.per_task_offset + page.per_task.length);
    taskInfo.textContent = page.per_task_total ? `${page.per_task_offset + 1}–${end} of ${page.per_task_total} task(s)` : "no tasks";
    taskPrev.disabled = page.per_task_offset === 0; taskNext.disabled = end >= page.per_task_total;
  };
  const loadTasks = async () => showTasks(await api(`/api/compare?a=${enc(a)}&b=${enc(b)}&offset=${taskState.offset}&limit=${taskState.limit}&q=${enc(taskState.q)}`));
  const taskPrev = h("button", {id: "compare-tasks-prev", onclick: () => { taskState.offset = Math.max(0, taskState.offset - taskState.limit); loadTasks(); }}, "‹ prev");
  const taskNext = h("button", {id: "compare-tasks-next", onclick: () => { taskState.offset += taskState.limit; loadTasks(); }}, "next ›");
  const taskSearch = h("input", {id: "compare-task-search", placeholder: "filter: task id"});
  let typing = null;
  taskSearch.addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(() => { taskState.q = taskSearch.value; taskState.offset = 0; loadTasks(); }, 200); });
  const perTask = h("div", {class: "card"}, h("h2", {text: "Per task"}), h("div", {class: "filters"}, taskSearch, taskPrev, taskNext, taskInfo),
    h("table", {id: "compare-tasks"},
      h("thead", {}, h("tr", {}, ["task", `${data.a}`, `${data.b}`, "mean reward a", "b", "Δ", "pass@1 a", "b", "Δ", "failure kinds a", "b", "mean tokens a", "b", "Δ"]
        .map((x) => h("th", {text: x})))), taskBody));
  showTasks(data);
  const fk = h("div", {class: "card"}, h("h2", {text: "Failure kinds (sessions; - : none)"}), h("table", {id: "compare-kinds"},
    h("thead", {}, h("tr", {}, ["failure kind", data.a, data.b, "Δ"].map((x) => h("th", {text: x})))),
    h("tbody", {}, data.failure_kinds.map((f) => h("tr", {"data-kind": f.kind}, h("td", {text: f.kind}),
      h("td", {class: "num", "data-cell": "a", text: f.a}), h("td", {class: "num", "data-cell": "b", text: f.b}), delta({v: f.a}, {v: f.b}, "v", 0, f.kind === "-" ? 1 : -1))))));
  const tt = data.totals;
  const totals = h("div", {class: "card"}, h("h2", {text: "Tokens and cost"}), h("table", {id: "compare-totals"},
    h("thead", {}, h("tr", {}, ["", data.a, data.b, "Δ"].map((x) => h("th", {text: x})))),
    h("tbody", {}, [["sessions", "sessions", 0], ["sampled tokens", "sampled_tokens", -1], ["engine seconds", "engine_seconds", -1], ["wall s", "wall_s", -1]].map(([label, key, better]) =>
      h("tr", {"data-total": key}, h("th", {text: label}), h("td", {class: "num", text: fmt(tt.a[key], 1)}), h("td", {class: "num", text: fmt(tt.b[key], 1)}), delta(tt.a, tt.b, key, 1, better))))));
  put(h("h1", {text: `Compare: ${data.a} → ${data.b}`}), warning,
    h("p", {class: "muted", text: "Unbiased pass@k over finished sessions (a session passes with reward ≥ 1); Δ is the second run minus the first."}),
    ...sections, perTask, h("div", {class: "grid2"}, fk, totals));
}
