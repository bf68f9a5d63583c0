// Nexus dashboard: reads /api/usage-stream (Server-Sent Events) and the
// history endpoint, and draws with plain DOM and SVG. No build step.
"use strict";

(function () {
  const RATE_WINDOW_S = 60; // rates are averaged over the last minute
  const LIVE_CHART_S = 300; // the live chart shows five minutes
  const HISTORY_REFRESH_MS = 60000;
  const SVG_NS = "http://www.w3.org/2000/svg";

  const body = document.body;
  const streamUrl = body.dataset.streamUrl;
  const historyUrl = body.dataset.historyUrl;

  // Cluster totals over time: {t (s), requests, errors, tokens, byModel{}}.
  // Counters only grow while servers run; a drop means a restart, after
  // which the window starts again.
  let samples = [];
  let latest = null;
  // Request rate per point of the live chart: {t, rate}.
  let ratePoints = [];

  function $(id) {
    return document.getElementById(id);
  }

  function format(n, digits) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    return n.toLocaleString(undefined, {
      maximumFractionDigits: digits === undefined ? 0 : digits,
      minimumFractionDigits: digits === undefined ? 0 : digits,
    });
  }

  function formatMs(ms) {
    if (ms === null || ms === undefined) return "–";
    return ms >= 1000 ? format(ms / 1000, 2) + " s" : format(ms, 0) + " ms";
  }

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function fillTable(id, rows, emptyText, columns) {
    const tbody = $(id).querySelector("tbody");
    tbody.replaceChildren();
    if (!rows.length) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = cell(emptyText);
      td.colSpan = columns;
      tr.append(td);
      tbody.append(tr);
      return;
    }
    for (const row of rows) tbody.append(row);
  }

  function totalsOf(event) {
    const totals = { requests: 0, errors: 0, tokens: 0, inFlight: 0, byModel: {} };
    for (const s of event.series) {
      totals.requests += s.requests;
      totals.errors += s.errors;
      totals.tokens += s.total_tokens;
      totals.inFlight += s.in_flight;
      const m = (totals.byModel[s.model] = totals.byModel[s.model] || {
        requests: 0,
        errors: 0,
        tokens: 0,
      });
      m.requests += s.requests;
      m.errors += s.errors;
      m.tokens += s.total_tokens;
    }
    return totals;
  }

  function addSample(totals, t) {
    const last = samples[samples.length - 1];
    if (last && totals.requests < last.requests) samples = [];
    samples.push(Object.assign({ t: t }, totals));
    while (samples.length > 2 && samples[1].t < t - RATE_WINDOW_S) samples.shift();
  }

  // Per-second rates over the window, up to `now` (so idle time lowers them).
  function rates(now) {
    if (samples.length === 0) return null;
    const first = samples[0];
    const last = samples[samples.length - 1];
    // Divide by the whole window even when the page has watched for less:
    // one request a second after loading is not "one request per second".
    const span = Math.max(now - first.t, RATE_WINDOW_S);
    const byModel = {};
    for (const model of Object.keys(last.byModel)) {
      const before = first.byModel[model] || { tokens: 0 };
      byModel[model] = ((last.byModel[model].tokens - before.tokens) / span) * 60;
    }
    const requests = last.requests - first.requests;
    return {
      requestsPerSecond: requests / span,
      tokensPerMinute: ((last.tokens - first.tokens) / span) * 60,
      errorRate: requests > 0 ? (last.errors - first.errors) / requests : null,
      byModel: byModel,
    };
  }

  function render() {
    if (!latest) return;
    const now = Date.now() / 1000;
    const totals = totalsOf(latest);
    const r = rates(now);
    $("request-rate").textContent = format(r.requestsPerSecond, 2);
    $("token-rate").textContent = format(r.tokensPerMinute, 0);
    $("in-flight").textContent = format(totals.inFlight);
    $("error-rate").textContent =
      r.errorRate === null ? "–" : format(r.errorRate * 100, 1) + " %";
    $("total-requests").textContent = format(totals.requests);
    $("total-tokens").textContent = format(totals.tokens);
    $("processes").textContent =
      latest.processes.length === 1
        ? "1 serving process"
        : latest.processes.length + " serving processes";

    const latency = {};
    for (const l of latest.latency) latency[l.model] = l;
    const modelRows = Object.keys(totals.byModel)
      .sort()
      .map(function (model) {
        const m = totals.byModel[model];
        const l = latency[model] || {};
        const tr = document.createElement("tr");
        tr.dataset.model = model;
        tr.append(
          cell(model),
          cell(format(r.byModel[model] || 0, 0), "num"),
          cell(formatMs(l.p50_ms), "num"),
          cell(formatMs(l.p95_ms), "num"),
          cell(format(m.requests), "num"),
          cell(format(m.errors), "num")
        );
        return tr;
      });
    fillTable("models", modelRows, "No traffic yet.", 6);

    const backendRows = latest.backends.map(function (b) {
      const tr = document.createElement("tr");
      tr.dataset.backend = b.name;
      const status = b.enabled ? b.status : "disabled";
      const health = cell(status, "status status-" + status);
      if (b.last_error) health.title = b.last_error;
      tr.append(
        cell(b.name),
        health,
        cell(format(b.in_flight), "num"),
        cell(formatMs(b.avg_latency_ms), "num"),
        cell(b.last_check_at ? new Date(b.last_check_at).toLocaleTimeString() : "never")
      );
      return tr;
    });
    fillTable("backends", backendRows, "No backends configured.", 5);

    ratePoints.push({ t: now, rate: r.requestsPerSecond });
    while (ratePoints.length && ratePoints[0].t < now - LIVE_CHART_S) ratePoints.shift();
    drawLine($("live-chart"), ratePoints, now - LIVE_CHART_S, now);
  }

  function svg(name, attrs) {
    const el = document.createElementNS(SVG_NS, name);
    for (const key of Object.keys(attrs)) el.setAttribute(key, attrs[key]);
    return el;
  }

  // Labels live in HTML beside the chart: SVG text would stretch with it.
  function label(chart, text) {
    $(chart.id + "-label").textContent = text;
  }

  function drawLine(chart, points, from, to) {
    chart.replaceChildren();
    const width = 600;
    const height = 120;
    const peak = Math.max(0, ...points.map((p) => p.rate));
    const max = Math.max(0.1, peak); // keep a quiet line near the bottom
    const x = (t) => ((t - from) / (to - from)) * width;
    const y = (v) => height - 4 - (v / max) * (height - 20);
    if (points.length > 1) {
      const line = points.map((p) => x(p.t).toFixed(1) + "," + y(p.rate).toFixed(1));
      chart.append(
        svg("polygon", {
          class: "area",
          points: x(points[0].t) + "," + height + " " + line.join(" ") + " " +
            x(points[points.length - 1].t) + "," + height,
        }),
        svg("polyline", { class: "line", points: line.join(" ") })
      );
    }
    label(chart, "peak " + format(peak, 2) + " req/s");
  }

  function drawBars(chart, points) {
    chart.replaceChildren();
    const width = 600;
    const height = 120;
    const max = Math.max(1, ...points.map((p) => p.requests));
    const step = width / Math.max(points.length, 1);
    points.forEach(function (p, i) {
      if (!p.requests) return;
      const h = (p.requests / max) * (height - 20);
      const eh = (p.errors / max) * (height - 20);
      const bar = svg("rect", {
        class: "bar",
        x: (i * step).toFixed(1),
        y: (height - h).toFixed(1),
        width: Math.max(step - 1, 1).toFixed(1),
        height: h.toFixed(1),
      });
      const title = svg("title", {});
      title.textContent =
        new Date(p.start).toLocaleTimeString() + ": " + p.requests + " requests, " +
        p.errors + " errors, " + p.total_tokens + " tokens";
      bar.append(title);
      chart.append(bar);
      if (eh > 0) {
        chart.append(
          svg("rect", {
            class: "bar-error",
            x: (i * step).toFixed(1),
            y: (height - eh).toFixed(1),
            width: Math.max(step - 1, 1).toFixed(1),
            height: eh.toFixed(1),
          })
        );
      }
    });
    const total = points.reduce((sum, p) => sum + p.requests, 0);
    label(chart, total ? "peak " + format(max) + " requests" : "no requests");
  }

  async function loadHistory(range) {
    try {
      const response = await fetch(historyUrl + "?range=" + range, {
        credentials: "same-origin",
      });
      if (!response.ok) throw new Error(response.status);
      const history = await response.json();
      drawBars($("history-" + range), history.points);
      let requests = 0;
      let tokens = 0;
      for (const p of history.points) {
        requests += p.requests;
        tokens += p.total_tokens;
      }
      const top = Object.entries(history.tokens_by_model)
        .slice(0, 3)
        .map(([model, n]) => model + " " + format(n))
        .join(", ");
      $("history-" + range + "-summary").textContent =
        format(requests) + " requests, " + format(tokens) + " tokens" +
        (top ? " (top: " + top + ")" : "");
    } catch (error) {
      $("history-" + range + "-summary").textContent = "History unavailable.";
    }
  }

  function onEvent(message) {
    latest = JSON.parse(message.data);
    // Client time, not the server's: the window is measured against Date.now().
    addSample(totalsOf(latest), Date.now() / 1000);
    render();
  }

  function connect() {
    const connection = $("connection");
    const source = new EventSource(streamUrl);
    source.addEventListener("snapshot", onEvent);
    source.addEventListener("update", onEvent);
    source.onopen = function () {
      connection.textContent = "live";
      connection.className = "pill pill-ok";
    };
    source.onerror = function () {
      // EventSource reconnects by itself; show that the numbers may be stale.
      connection.textContent = "reconnecting…";
      connection.className = "pill pill-bad";
    };
  }

  connect();
  // Rates are windowed over time: redraw even when no event arrives.
  setInterval(render, 1000);
  for (const range of ["hour", "day"]) {
    loadHistory(range);
    setInterval(() => loadHistory(range), HISTORY_REFRESH_MS);
  }
})();
