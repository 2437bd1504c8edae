// The kvroute dashboard: polls /dashboard/state every 2 s and re-renders the page from it.
// Vanilla JS, no dependencies: the page must work with no network beyond the router.
// Every value goes in through textContent (never innerHTML): request ids and model names are
// client or worker input.
"use strict";

(function () {
  const POLL_MS = 2000;
  const STATE_URL = "/dashboard/state";
  let renders = 0;

  const $ = (id) => document.getElementById(id);

  function dash(value, format) {
    return value === null || value === undefined ? "–" : format(value);
  }
  const pct = (x) => dash(x, (v) => (100 * v).toFixed(1) + "%");
  const int = (x) => dash(x, (v) => Number(v).toLocaleString("en-US"));
  const secs = (x) => dash(x, (v) => (v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(1) + " s"));
  const clock = (t) => new Date(1000 * t).toLocaleTimeString("en-GB");
  const periodName = (i) => (i === 0 ? "last minute" : i + "–" + (i + 1) + " min ago");
  const target = (worker, rank) => (rank === null ? worker : worker + "#dp" + rank);
  // a worker whose KV events the false-hit watch left unfollowed: routed by load, no hit
  // predicted, for the seconds shown
  const unfollowed = (left) => "unfollowed, " + Math.ceil(left) + " s left";
  // a decision's predicted match, and the index's raw one where the admission forecast said
  // part of it would be evicted first
  const matched = (d) =>
    int(d.matched_tokens) +
    (d.raw_matched_tokens > d.matched_tokens ? " (" + int(d.raw_matched_tokens) + " held)" : "");

  function td(value, cls) {
    const cell = document.createElement("td");
    cell.textContent = String(value);
    if (cls) cell.className = cls;
    return cell;
  }

  // rows: the items; cells(item) -> [[text, class?], ...]; key(item) -> data-key of the row
  function fill(tableId, rows, cells, key) {
    const body = $(tableId).tBodies[0];
    const out = rows.map((item) => {
      const tr = document.createElement("tr");
      tr.dataset.key = key(item);
      for (const [text, cls] of cells(item)) tr.appendChild(td(text, cls));
      return tr;
    });
    if (!out.length) {
      const tr = document.createElement("tr");
      const cell = td("none yet", "empty");
      cell.colSpan = $(tableId).tHead.rows[0].cells.length;
      tr.appendChild(cell);
      out.push(tr);
    }
    body.replaceChildren(...out);
  }

  function sparkline(buckets) {
    const svg = $("sparkline");
    const SVG = svg.namespaceURI;
    const width = 300;
    const height = 60;
    const step = buckets.length > 1 ? width / (buckets.length - 1) : width;
    const parts = [];
    const grid = document.createElementNS(SVG, "line");
    for (const [name, attr] of [["x1", 0], ["x2", width], ["y1", height / 2], ["y2", height / 2]])
      grid.setAttribute(name, attr);
    grid.setAttribute("class", "grid");
    parts.push(grid);
    for (const [text, x, y, anchor] of [
      ["100%", 2, 8, "start"], ["0%", 2, height - 3, "start"],
      ["5 min ago", 18, height - 3, "start"], ["now", width - 2, height - 3, "end"],
    ]) {
      const label = document.createElementNS(SVG, "text");
      label.setAttribute("x", x);
      label.setAttribute("y", y);
      label.setAttribute("text-anchor", anchor);
      label.setAttribute("class", "axis");
      label.textContent = text;
      parts.push(label);
    }
    for (const [field, cls] of [["predicted_hit_rate", "predicted"], ["hit_rate", "hit"], ["accuracy", "accuracy"]]) {
      // one polyline per run of buckets with data: an idle bucket is a gap, not a zero
      let run = [];
      const flush = () => {
        if (run.length) {
          const line = document.createElementNS(SVG, run.length > 1 ? "polyline" : "circle");
          if (run.length > 1) line.setAttribute("points", run.join(" "));
          else {
            const [x, y] = run[0].split(",");
            line.setAttribute("cx", x);
            line.setAttribute("cy", y);
            line.setAttribute("r", "1.5");
          }
          line.setAttribute("class", cls);
          parts.push(line);
        }
        run = [];
      };
      buckets.forEach((b, i) => {
        const v = b[field];
        if (v === null) flush();
        else run.push((i * step).toFixed(1) + "," + (height - 2 - v * (height - 4)).toFixed(1));
      });
      flush();
    }
    svg.replaceChildren(...parts);
  }

  function render(s) {
    const routable = s.workers.filter((w) => w.status === "ready").length;
    const synced = s.streams.filter((x) => x.state === "synced").length;
    const total = s.prediction.total;
    $("policy").textContent = s.policy;
    $("logout").hidden = !s.login;
    $("cluster").textContent = s.cluster
      ? "replica " + s.cluster.replica + " of " + s.cluster.replicas + " (" + s.cluster.status + ")"
      : "";
    $("card-workers").textContent = routable + " / " + s.workers.length;
    $("card-streams").textContent = synced + " / " + s.streams.length;
    $("card-namespaces").textContent = int(s.namespace_count);
    $("card-requests").textContent = int(total.requests);
    $("card-accuracy").textContent = pct(total.accuracy);
    $("card-hit").textContent = pct(total.hit_rate) + " (" + pct(total.predicted_hit_rate) + ")";

    sparkline(s.prediction.buckets);
    // newest first; periods end now (10 s buckets), not on the clock's minutes
    const periods = s.prediction.minutes.slice().reverse();
    fill("minutes", periods, (m) => [
      [periodName(periods.indexOf(m))], [int(m.requests)], [int(m.usage_reports)],
      [pct(m.accuracy)], [pct(m.hit_rate)], [pct(m.predicted_hit_rate)],
    ], (m) => String(m.start));

    fill("workers", s.workers, (w) => [
      [w.id],
      w.unfollowed_s > 0
        ? [w.status + " (" + unfollowed(w.unfollowed_s) + ")", "state-unfollowed"]
        : [w.status, "state-" + w.status.replace(/\W+/g, "-")],
      [w.role], [w.model || "–"],
      [int(w.running)], [int(w.queued_prefill_tokens)], [w.breaker], [w.url],
    ], (w) => w.id);
    const left = new Map(s.workers.filter((w) => w.unfollowed_s > 0).map((w) => [w.id, w.unfollowed_s]));
    fill("ranks", s.ranks, (r) => [
      [r.worker], [r.dp_rank === null ? "–" : r.dp_rank],
      left.has(r.worker)
        ? [unfollowed(left.get(r.worker)), "state-unfollowed"]
        : [r.stream_state || "–", r.stream_state ? "state-" + r.stream_state : ""],
      [int(r.running)], [int(r.queued_prefill_tokens)], [int(r.kv_tokens)],
    ], (r) => target(r.worker, r.dp_rank));
    fill("streams", s.streams, (x) => [
      [x.stream], [x.state, "state-" + x.state], [secs(x.lag_s)], [dash(x.last_seq, String)],
      [int(x.entries)], [dash(x.block_size, String)], [int(x.gaps)], [int(x.replays)],
      [int(x.restarts)], [int(x.decode_errors)],
    ], (x) => x.stream);

    $("namespace-count").textContent =
      s.namespaces.length < s.namespace_count
        ? "(the largest " + s.namespaces.length + " of " + s.namespace_count + ")"
        : "(" + s.namespace_count + ")";
    fill("namespaces", s.namespaces, (n) => [
      [n.id, "mono"], [n.model], [n.lora || "–"], [n.salted ? "yes" : "no"],
      [int(n.blocks)], [int(n.tokens)],
      [Object.entries(n.holders).map(([w, b]) => w + ": " + b).join(", ") || "–"],
    ], (n) => n.id);

    fill("decisions", s.decisions, (d) => [
      [clock(d.at)], [d.request_id, "mono clip"],
      [target(d.worker, d.dp_rank) + (d.attempt ? " (retry " + d.attempt + ")" : "")],
      [d.model || "–"], [d.namespace, "mono"], [int(d.prompt_tokens)], [matched(d)],
      [int(d.cached_tokens)], [dash(d.status, String)], [secs(d.ttft_s)],
      [d.reason + ": " + d.explanation, "why"],
    ], (d) => d.request_id);
  }

  function setStatus(text, ok) {
    const badge = $("status");
    badge.textContent = text;
    badge.className = "badge " + (ok ? "ok" : "bad");
  }

  async function poll() {
    try {
      const resp = await fetch(STATE_URL, { cache: "no-store", credentials: "same-origin" });
      if (resp.status === 401) {
        location.assign("/dashboard"); // the session ended: the login form
        return;
      }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      const state = await resp.json();
      render(state);
      renders += 1;
      document.body.dataset.renders = String(renders);
      const updated = $("updated");
      updated.textContent = clock(state.generated_at);
      updated.dateTime = new Date(1000 * state.generated_at).toISOString();
      setStatus("live", true);
    } catch (err) {
      // keep the last picture on screen, say it is old
      setStatus("not updating: " + err.message, false);
    }
    setTimeout(poll, POLL_MS);
  }

  poll();
})();
