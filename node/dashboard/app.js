// The diloco-node dashboard: polls this peer's /v1/status (docs/status.md) every 2 s and draws the swarm as
// this peer sees it. Plain JavaScript, no dependency, nothing fetched from elsewhere. Every value from the
// status object is written with textContent (a region label is free text of another peer): never innerHTML.
// A key the peer does not send (an older version) shows as "—".
"use strict";

(() => {
  const POLL_MS = 2000;
  const LOCAL_KEPT = 720; // samples kept (the peer keeps as many: HISTORY_KEPT, docs/status.md)
  const DASH = "—";
  const MIN_SPAN_S = 60; // the charts' time axis spans at least this much
  const COLORS = ["#2f6fdf", "#e0702a", "#2a9d5b", "#b03fbf", "#c9a227", "#17a2b8", "#d6336c", "#6c757d"];

  const local = []; // this page's own samples (used only when the status has no `history`)
  const hist = []; // the peer's `history`, merged over polls: after the first, only newer samples are asked for
  let last = null;
  let lastOk = 0;
  let sortKey = "peer";
  let sortDir = 1;

  // -- small helpers --------------------------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);
  const has = (x) => x !== undefined && x !== null;
  const isNum = (x) => typeof x === "number" && Number.isFinite(x);

  function el(tag, cls, text, title) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (has(text)) e.textContent = String(text);
    if (title) e.title = title;
    return e;
  }

  function num(x, digits = 3) {
    if (!isNum(x)) return DASH;
    if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en-US");
    return x.toFixed(digits);
  }

  function si(x, unit = "") {
    if (!isNum(x)) return DASH;
    const a = Math.abs(x);
    for (const [f, p] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
      if (a >= f) return (x / f).toFixed(a >= 10 * f ? 1 : 2) + " " + p + unit;
    }
    return (a >= 10 || a === 0 ? x.toFixed(0) : x.toFixed(1)) + (unit ? " " + unit : "");
  }

  function age(s) {
    if (!isNum(s)) return DASH;
    if (s < 0) s = 0;
    if (s < 10) return s.toFixed(1) + "s";
    if (s < 120) return Math.round(s) + "s";
    if (s < 7200) return Math.floor(s / 60) + "m" + String(Math.round(s % 60)).padStart(2, "0") + "s";
    return (s / 3600).toFixed(1) + "h";
  }

  const short = (pid) => (typeof pid === "string" && pid ? pid.slice(0, 8) : DASH);
  const pct = (x) => (isNum(x) ? (100 * x).toFixed(1) + "%" : DASH);

  // A version "TERM.VERSION" (protocol §7.3) as a person reads it: "v16 · term 115576".
  function splitVersion(label) {
    if (typeof label !== "string") return null;
    const m = /^(\d+)\.(\d+)$/.exec(label);
    return m ? { term: Number(m[1]), number: Number(m[2]) } : null;
  }

  function versionText(term, number) {
    if (!isNum(term) || !isNum(number)) return DASH;
    if (term === 0 && number === 0) return "v0 · initial";
    return "v" + number + " · term " + term;
  }

  function heldVersion(f) {
    if (isNum(f.term) && isNum(f.number)) return { term: f.term, number: f.number };
    return splitVersion(f.version);
  }

  // -- the poll -------------------------------------------------------------------------------------------

  async function poll() {
    try {
      const after = hist.length ? "?history_after=" + hist[hist.length - 1].t : "";
      const r = await fetch("v1/status" + after, { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status + " " + (await r.text()).trim().slice(0, 200));
      const st = await r.json();
      merge(st.history);
      last = st;
      lastOk = Date.now();
      remember(st);
      render(st, null);
    } catch (e) {
      render(last, String(e && e.message ? e.message : e));
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  function merge(samples) {
    if (!Array.isArray(samples)) return;
    for (const s of samples) {
      if (isNum(s.t) && (!hist.length || s.t > hist[hist.length - 1].t)) hist.push(s);
    }
    if (hist.length > LOCAL_KEPT) hist.splice(0, hist.length - LOCAL_KEPT);
  }

  // One sample in the contract's `history` shape, from one status (used when the peer keeps no history).
  function remember(st) {
    const bytes = {};
    const add = (route, inn, out) => {
      const b = (bytes[route] = bytes[route] || { in: 0, out: 0 });
      b.in += inn || 0;
      b.out += out || 0;
    };
    const b = st.bytes || {};
    for (const [route, c] of Object.entries(b.served || {})) add(route, c.bytes_in, c.bytes_out);
    for (const [path, c] of Object.entries(b.sent || {})) add(routeOf(path), c.bytes_in, c.bytes_out);
    local.push({
      t: Date.now() / 1000, step: st.step, tokens: st.tokens, loss: st.loss, eval_loss: st.eval_loss,
      tokens_per_s: st.tokens_per_s, goodput: st.goodput, peers: (st.members || []).length, bytes,
    });
    if (local.length > LOCAL_KEPT) local.shift();
  }

  // A sent path ("/v1/updates/3?after=0.0") under its route pattern ("/v1/updates/{p}").
  function routeOf(path) {
    return String(path).split("?")[0].replace(/\/\d+$/, "/{p}");
  }

  // -- rendering ------------------------------------------------------------------------------------------

  function render(st, error) {
    renderConn(error);
    renderAlerts(st || {}, error);
    if (!st) return;
    renderHeader(st);
    renderPeers(st);
    renderFragments(st);
    renderCharts(st);
  }

  function renderConn(error) {
    const dot = $("conn");
    dot.className = "dot " + (error ? "bad" : "ok");
    dot.title = error ? "cannot reach this peer: " + error : "connected";
    tick();
  }

  function tick() {
    const u = $("updated");
    u.textContent = lastOk ? "updated " + age((Date.now() - lastOk) / 1000) + " ago" : "waiting for /v1/status…";
    u.className = "small " + (lastOk && Date.now() - lastOk > 3 * POLL_MS ? "bad-text" : "muted");
  }

  function tile(label, value, title, cls) {
    const t = el("div", "tile" + (cls ? " " + cls : ""), null, title);
    t.append(el("span", "v", value), el("span", "k", label));
    return t;
  }

  function renderHeader(st) {
    $("run").textContent = "run " + (st.run_name || DASH) + " (" + (st.run_id ? st.run_id.slice(0, 12) : DASH) + ")";
    $("self").textContent = "this peer " + short(st.peer_id) + (st.client_mode ? " (client mode)" : "");
    $("self").title = (st.peer_id || "") + (st.url ? "  " + st.url : "");
    document.title = "diloco-node · " + (st.run_name || "") + " · step " + (has(st.step) ? st.step : DASH);
    const bt = st.bytes_total || {};
    const state = st.healthy === false ? "failed" : st.synced ? "synced" : st.synced === false ? "syncing" : DASH;
    const tiles = [
      tile("step", has(st.step) ? st.step.toLocaleString("en-US") : DASH, "inner steps done"),
      tile("loss", num(st.loss), "the last training loss"),
      tile("eval loss", num(st.eval_loss), "the last held-out evaluation loss"),
      tile("tokens/s", si(st.tokens_per_s), "this learner's training speed"),
      tile("goodput", pct(st.goodput), "share of this learner's inner steps merged into a published version"),
      tile("peers", has(st.members) ? st.members.length : DASH, "live members as this peer sees them"),
      tile("in / out", si(bt.bytes_in, "B") + " / " + si(bt.bytes_out, "B"), "bytes received / sent, all routes"),
      tile("state", state, st.error || "", st.healthy === false ? "bad" : st.synced ? "good" : "warn"),
    ];
    $("tiles").replaceChildren(...tiles);
  }

  function renderAlerts(st, error) {
    const box = $("alerts");
    const items = [];
    if (error) items.push({ severity: "error", kind: "unreachable", message: "cannot reach this peer: " + error +
      (lastOk ? " (showing data from " + age((Date.now() - lastOk) / 1000) + " ago)" : "") });
    if (st.healthy === false) items.push({ severity: "error", kind: "failed", message: st.error || "background loop died" });
    for (const a of Array.isArray(st.alerts) ? st.alerts : []) items.push(a);
    box.hidden = items.length === 0;
    box.replaceChildren(...items.map((a) => {
      const row = el("div", "alert " + (a.severity === "error" ? "error" : "warning"));
      row.append(el("b", null, a.kind || "alert"), el("span", null, " " + (a.message || "")));
      const where = [];
      if (has(a.peer_id)) where.push("peer " + short(a.peer_id));
      if (has(a.fragment)) where.push("fragment " + a.fragment);
      if (isNum(a.since)) where.push("since " + age(Date.now() / 1000 - a.since) + " ago");
      if (where.length) row.append(el("span", "muted small", "  " + where.join(" · ")));
      return row;
    }));
  }

  // -- peers ----------------------------------------------------------------------------------------------

  const PEER_COLUMNS = [
    ["peer", "peer", "PeerId (first 8 characters); hover for the whole id and URL"],
    ["region", "region", "free-form region label"],
    ["state", "state", "training (synced), joining, suspect (a request failed), distrusted (refused update)"],
    ["step", "step", "inner steps, as of its last member record"],
    ["tps", "tokens/s", "tokens per second, from its member record"],
    ["mode", "mode", "server: takes connections; client: push and pull only"],
    ["roles", "owns · repl.", "fragments it owns · replicates, in this peer's view"],
    ["hb", "heartbeat", "seconds since its member record was refreshed; red past half the member TTL"],
  ];

  function memberRows(st) {
    const owns = {};
    const repl = {};
    for (const f of st.fragments || []) {
      const roles = Array.isArray(f.roles) ? f.roles : [];
      const owner = has(f.owner) ? f.owner : roles[0];
      const replicas = Array.isArray(f.replicas) ? f.replicas : roles.slice(1);
      if (owner) owns[owner] = (owns[owner] || 0) + 1;
      for (const r of replicas) repl[r] = (repl[r] || 0) + 1;
    }
    return (st.members || []).map((m) => {
      const self = m.peer_id === st.peer_id;
      const state = has(m.state) ? m.state : m.synced === true ? "training" : m.synced === false ? "joining" : null;
      const tps = isNum(m.tokens_per_s) ? m.tokens_per_s : self ? st.tokens_per_s : null;
      return {
        m, self, state, tps,
        peer: m.peer_id || "", region: m.region || "", step: m.step, mode: m.client_mode ? "client" : "server",
        roles: (owns[m.peer_id] || 0) * 1000 + (repl[m.peer_id] || 0),
        owns: owns[m.peer_id] || 0, repl: repl[m.peer_id] || 0, hb: m.heartbeat_age_s,
      };
    });
  }

  function renderPeers(st) {
    const table = $("peers");
    const head = table.tHead.rows[0];
    if (!head.cells.length) {
      for (const [key, label, title] of PEER_COLUMNS) {
        const th = el("th", "sortable", label, title + " (click to sort)");
        th.dataset.key = key;
        th.addEventListener("click", () => {
          sortDir = sortKey === key ? -sortDir : 1;
          sortKey = key;
          if (last) renderPeers(last);
        });
        head.append(th);
      }
    }
    for (const th of head.cells) th.classList.toggle("sorted", th.dataset.key === sortKey);
    for (const th of head.cells) th.dataset.dir = th.dataset.key === sortKey ? (sortDir > 0 ? "▲" : "▼") : "";
    const rows = memberRows(st);
    rows.sort((a, b) => {
      const x = a[sortKey];
      const y = b[sortKey];
      if (x === y) return a.peer < b.peer ? -1 : 1;
      if (!has(x)) return 1;
      if (!has(y)) return -1;
      return (x < y ? -1 : 1) * sortDir;
    });
    const ttl = st.member_ttl_s;
    const body = rows.map((r) => {
      const tr = el("tr", r.self ? "self" : "");
      tr.dataset.peer = r.peer;
      const idCell = el("td", "mono", short(r.peer), r.peer + (r.m.url ? "\n" + r.m.url : "\n(client mode)"));
      if (r.self) idCell.append(el("span", "you", "this peer"));
      const hbBad = isNum(r.hb) && isNum(ttl) && r.hb > ttl / 2;
      tr.append(
        idCell,
        el("td", "region", r.region || DASH, r.region),
        badgeCell(r.state),
        el("td", "num", has(r.step) ? r.step.toLocaleString("en-US") : DASH),
        el("td", "num", si(r.tps)),
        el("td", null, r.mode),
        el("td", "num", r.owns + " · " + r.repl),
        el("td", "num" + (hbBad ? " bad-text" : ""), age(r.hb),
          isNum(ttl) ? "member TTL " + ttl + "s: red past " + ttl / 2 + "s" : "member TTL unknown"),
      );
      return tr;
    });
    table.tBodies[0].replaceChildren(...body);
    $("peer-count").textContent = "(" + rows.length + ")";
  }

  function badgeCell(state) {
    const td = el("td");
    const cls = { training: "good", joining: "warn", suspect: "bad", distrusted: "bad" }[state] || "";
    td.append(el("span", "badge " + cls, state || DASH));
    return td;
  }

  // -- fragments ------------------------------------------------------------------------------------------

  function staleClass(n, max) {
    if (!isNum(n)) return "";
    if (n <= 0) return "s-ok";
    return isNum(max) && n > max ? "s-bad" : "s-warn";
  }

  function renderFragments(st) {
    const frags = st.fragments || [];
    const max = st.max_staleness;
    const cards = frags.map((f) => {
      const v = heldVersion(f);
      const roles = Array.isArray(f.roles) ? f.roles : [];
      const owner = has(f.owner) ? f.owner : roles[0];
      const replicas = Array.isArray(f.replicas) ? f.replicas : roles.slice(1);
      const card = el("div", "frag " + staleClass(f.staleness, max));
      card.dataset.p = f.p;
      const top = el("div", "row");
      top.append(el("b", null, "p" + f.p), el("span", "stale", isNum(f.staleness) ? f.staleness + " behind" : DASH,
        "staleness: versions between the newest known (" + (f.newest || DASH) + ") and the one held"));
      const ver = el("div", "ver mono", v ? versionText(v.term, v.number) : DASH, "held version " + (f.version || DASH));
      const nv = splitVersion(f.newest);
      const lines = [top, ver];
      if (nv && v && (nv.term !== v.term || nv.number !== v.number)) {
        lines.push(el("div", "small muted", "newest " + versionText(nv.term, nv.number)));
      }
      const own = el("div", "small", null, "owner " + (owner || "none") + "\nreplicas " + (replicas.join(", ") || "none"));
      own.append(el("span", "muted", "owner "), el("span", "mono" + (owner === st.peer_id ? " me" : ""), short(owner)),
        el("span", "muted", " +" + replicas.length + " repl."));
      lines.push(own);
      const moved = isNum(f.last_version_age_s) ? "moved " + age(f.last_version_age_s) + " ago" : "moved " + DASH;
      lines.push(el("div", "small muted", moved, "this peer last moved p" + f.p + " to a new version " +
        (isNum(f.last_version_age_s) ? age(f.last_version_age_s) + " ago" : "(unknown)") +
        "\nversions this peer published as owner: " + (has(f.outer_steps) ? f.outer_steps : DASH)));
      lines.push(learnerStrip(f, max));
      card.append(...lines);
      return card;
    });
    $("frags").replaceChildren(...(cards.length ? cards : [el("p", "muted", "no fragments " + DASH)]));
    $("frag-count").textContent = "(" + frags.length + (isNum(max) ? ", max staleness " + max : "") + ")";
  }

  function learnerStrip(f, max) {
    const strip = el("div", "strip");
    const ms = f.member_staleness;
    if (!ms || typeof ms !== "object") {
      strip.append(el("span", "small muted", "per learner " + DASH));
      return strip;
    }
    const entries = Object.entries(ms).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
    if (!entries.length) strip.append(el("span", "small muted", "per learner " + DASH));
    for (const [pid, n] of entries) strip.append(el("i", "sq " + staleClass(n, max), null, short(pid) + ": " + n + " behind"));
    return strip;
  }

  // -- charts ---------------------------------------------------------------------------------------------

  function samples(st) {
    return Array.isArray(st.history) ? hist : local;
  }

  function renderCharts(st) {
    const h = samples(st);
    const pts = (key) => h.filter((s) => isNum(s[key]) && isNum(s.t)).map((s) => [s.t, s[key]]);
    chart("chart-loss", [{ name: "loss", points: pts("loss") }, { name: "eval", points: pts("eval_loss"), dash: true }],
      { fmt: (x) => num(x, 2) });
    chart("chart-tps", [{ name: "tokens/s", points: pts("tokens_per_s") }], { fmt: (x) => si(x), zero: true });
    chart("chart-goodput", [{ name: "goodput", points: pts("goodput") }], { fmt: pct, zero: true, max: 1 });
    chart("chart-bytes", byteRates(h), { fmt: (x) => si(x, "B"), zero: true });
  }

  // Bytes per second per route (in + out) between consecutive samples; the 6 busiest routes, the rest summed.
  function byteRates(h) {
    const totals = {};
    const newest = h.length ? h[h.length - 1].bytes || {} : {};
    for (const [route, b] of Object.entries(newest)) totals[route] = (b.in || 0) + (b.out || 0);
    const routes = Object.keys(totals).sort((a, b) => totals[b] - totals[a]);
    const top = routes.slice(0, 6);
    const rest = routes.slice(6);
    const sum = (s, names) => names.reduce((acc, r) => acc + (((s.bytes || {})[r] || {}).in || 0) + (((s.bytes || {})[r] || {}).out || 0), 0);
    const series = top.map((r) => ({ name: r, names: [r] }));
    if (rest.length) series.push({ name: "other " + rest.length, names: rest });
    return series.map((s) => {
      const points = [];
      for (let i = 1; i < h.length; i++) {
        const dt = h[i].t - h[i - 1].t;
        if (dt > 0) points.push([h[i].t, Math.max(0, (sum(h[i], s.names) - sum(h[i - 1], s.names)) / dt)]);
      }
      return { name: s.name, points, title: s.name + ": " + si(sum(h[h.length - 1], s.names), "B") + " in total" };
    });
  }

  const SVG = "http://www.w3.org/2000/svg";

  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (has(text)) e.textContent = text;
    return e;
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return [d.getHours(), d.getMinutes(), d.getSeconds()].map((x) => String(x).padStart(2, "0")).join(":");
  }

  function chart(id, series, opts) {
    const fig = $(id);
    const box = fig.querySelector(".plot");
    const legend = fig.querySelector(".legend");
    legend.replaceChildren(...series.map((s, i) => {
      const item = el("span", "li", null, s.title || "");
      item.append(el("i", "sw"), document.createTextNode(s.name.replace(/^\/v1\//, "")));
      item.firstChild.style.background = COLORS[i % COLORS.length];
      return item;
    }));
    const W = Math.max(160, box.clientWidth || 300);
    const H = Math.max(90, box.clientHeight || 130);
    const pad = { l: 52, r: 8, t: 6, b: 18 };
    const all = series.flatMap((s) => s.points);
    const root = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img" });
    if (all.length === 0) {
      root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet " + DASH));
      box.replaceChildren(root);
      return;
    }
    let t0 = Math.min(...all.map((p) => p[0]));
    let t1 = Math.max(...all.map((p) => p[0]));
    if (t1 - t0 < MIN_SPAN_S) t0 = t1 - MIN_SPAN_S; // (a few first samples: at the right, not stretched)
    let y0 = Math.min(...all.map((p) => p[1]));
    let y1 = Math.max(...all.map((p) => p[1]));
    if (opts.zero) y0 = Math.min(0, y0);
    if (isNum(opts.max)) y1 = Math.max(y1, opts.max);
    if (y1 - y0 < 1e-9) { y1 += Math.abs(y1) * 0.1 || 1; y0 -= opts.zero ? 0 : Math.abs(y0) * 0.1 || 1; }
    const X = (t) => pad.l + ((t - t0) / (t1 - t0)) * (W - pad.l - pad.r);
    const Y = (v) => pad.t + (1 - (v - y0) / (y1 - y0)) * (H - pad.t - pad.b);
    for (let k = 0; k <= 3; k++) {
      const v = y0 + ((y1 - y0) * k) / 3;
      root.append(svg("line", { x1: pad.l, x2: W - pad.r, y1: Y(v), y2: Y(v), class: "gridline" }));
      root.append(svg("text", { x: pad.l - 4, y: Y(v) + 4, "text-anchor": "end", class: "tick" }, opts.fmt(v)));
    }
    root.append(svg("text", { x: pad.l, y: H - 4, class: "tick" }, clock(t0)));
    root.append(svg("text", { x: W - pad.r, y: H - 4, "text-anchor": "end", class: "tick" }, clock(t1)));
    series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      if (!s.points.length) return;
      if (s.points.length === 1) {
        const [t, v] = s.points[0];
        root.append(svg("circle", { cx: X(t), cy: Y(v), r: 2.5, fill: color }));
        return;
      }
      const d = s.points.map(([t, v], j) => (j ? "L" : "M") + X(t).toFixed(1) + " " + Y(v).toFixed(1)).join("");
      root.append(svg("path", { d, fill: "none", stroke: color, "stroke-width": 1.6,
        ...(s.dash ? { "stroke-dasharray": "5 3" } : {}) }));
    });
    box.replaceChildren(root);
  }

  window.addEventListener("resize", () => { if (last) renderCharts(last); });
  setInterval(tick, 1000);
  poll();
})();
