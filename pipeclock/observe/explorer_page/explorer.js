"use strict";
// The explorer's page. The schedules come from pipeclock's generators as data (the JSON above); this script
// only times them, by the rules of pipeclock/observe/simulate.py, and reads the figures the way
// pipeclock/observe/timeline.py does, so the page and `python -m pipeclock schedule` agree.

const DATA = JSON.parse(document.getElementById("explorer-data").textContent);
const OPS = ["F", "B", "I", "W"];
const DEFAULTS = { schedule: "1f1b", compare: "zb-h1", p: 4, m: 8, chunks: 2, F: 1, B: 2, I: 1, W: 1, message: 0 };
const NUMBERS = ["p", "m", "chunks", "F", "B", "I", "W", "message"];
const COUNTS = ["p", "m", "chunks"];

// ---- the schedules, as pipeclock's generators wrote them

/** A row's actions, as pipeclock.observe.explorer.schedule_case wrote them: op, micro-batch, chunk. */
function parseRow(row, digits, chunked) {
  const width = 1 + digits + (chunked ? 1 : 0);
  const actions = [];
  for (let at = 0; at < row.length; at += width) {
    const op = row[at];
    const mb = parseInt(row.slice(at + 1, at + 1 + digits), 36);
    const chunk = chunked ? parseInt(row[at + 1 + digits], 36) : 0;
    actions.push({ op: op === "f" ? "F" : op, mb, chunk, overlap: op === "f" });
  }
  return actions;
}

function actionText(action) {
  return action.op + action.mb + (action.chunk ? "." + action.chunk : "");
}

function chunksOf(name, chosen) {
  const info = DATA.schedules[name];
  if (info.chunks !== null) return info.chunks;
  return info.interleaves ? chosen : 1;
}

/** The schedule `name` at (p, m, chunks), or {error} as pipeclock said it (or as this page's grid limits). */
function lookUp(name, p, m, chunks) {
  const grid = DATA.grid;
  if (p > grid.stages || m > grid.microbatches || (DATA.schedules[name].interleaves && chunks > grid.chunks)) {
    return {
      error: `this page holds p up to ${grid.stages}, m up to ${grid.microbatches}, ` +
        `chunks up to ${grid.chunks} (python -m pipeclock schedule takes any)`,
    };
  }
  const found = DATA.cases[`${name}/${p}/${m}/${chunks}`];
  if (found.error) return found;
  const digits = (m - 1).toString(36).length;
  const chunked = Math.max(...found.stages.map((held) => held.length)) > 1;
  const rows = found.rows.map((row) => parseRow(row, digits, chunked));
  return { stages: found.stages, rows, caveat: found.caveat || "" };
}

// ---- the simulator: pipeclock/observe/simulate.py, rule for rule (the program's rules)

function eventKey(rank, op, mb, chunk) {
  return `${rank}:${op}${mb}.${chunk}`;
}

/** What must have happened before `action` on `rank`: engine/actions.py's `dependencies`. */
function dependencies(action, rank, stages, owner) {
  const stage = stages[rank][action.chunk];
  const needs = [];
  if (action.op === "F" && stage > 0) {
    const [before, chunk] = owner[stage - 1];
    needs.push([before, "F", action.mb, chunk]);
  } else if (action.op === "B" || action.op === "I") {
    needs.push([rank, "F", action.mb, action.chunk]);
    if (stage < owner.length - 1) {
      const [after, chunk] = owner[stage + 1];
      needs.push([after, "B", action.mb, chunk]); // the gradient, from a B or an I
    }
  } else if (action.op === "W") {
    needs.push([rank, "I", action.mb, action.chunk]);
  }
  return needs;
}

/**
 * The spans of `schedule` when op X costs `cost[X]` and a message `message`; or {deadlock}. The rules of
 * the program the engine runs (pipeclock/engine/program.py): a rank posts the receives of an action (or
 * of an overlapped pair) when it reaches it; an action sends its output after its group ends; a message
 * leaves once both are posted and arrives `message` later; within a rank, data is there when computed.
 */
function simulate(schedule, cost, message) {
  const { stages, rows } = schedule;
  const owner = [];
  stages.forEach((held, rank) => held.forEach((stage, chunk) => (owner[stage] = [rank, chunk])));
  const position = rows.map(() => 0);
  const freeAt = rows.map(() => 0);
  const postedAt = rows.map(() => 0); // when the rank reached its current group
  const groupStart = rows.map(() => 0); // its current group: one action, or an overlapped pair
  const groupEnd = rows.map(() => 0);
  const done = new Map(); // computed, on its own rank
  const sent = new Map(); // sent to another rank, once its group ended
  const spans = [];

  function ready(rank, needs) {
    let at = 0;
    for (const [from, op, mb, chunk] of needs) {
      const key = eventKey(from, op, mb, chunk);
      if (from === rank) {
        if (!done.has(key)) return null;
        at = Math.max(at, done.get(key));
      } else {
        if (!sent.has(key)) return null;
        at = Math.max(at, Math.max(sent.get(key), postedAt[rank]) + message);
      }
    }
    return at;
  }

  function tryNext(rank) {
    const actions = rows[rank];
    const at = position[rank];
    if (at === actions.length) return false;
    if (at === groupEnd[rank]) {
      postedAt[rank] = freeAt[rank];
      groupStart[rank] = at;
      groupEnd[rank] = at + (actions[at].overlap && at + 1 < actions.length ? 2 : 1);
    }
    const action = actions[at];
    const inputs = ready(rank, dependencies(action, rank, stages, owner));
    if (inputs === null) return false;
    const start = Math.max(freeAt[rank], inputs);
    const end = start + cost[action.op];
    spans.push({ rank, action, start, end });
    done.set(eventKey(rank, action.op, action.mb, action.chunk), end);
    if (action.op === "I") done.set(eventKey(rank, "B", action.mb, action.chunk), end);
    freeAt[rank] = end;
    position[rank] += 1;
    if (position[rank] === groupEnd[rank]) {
      for (const made of actions.slice(groupStart[rank], groupEnd[rank])) {
        sent.set(eventKey(rank, made.op, made.mb, made.chunk), end);
        if (made.op === "I") sent.set(eventKey(rank, "B", made.mb, made.chunk), end);
      }
    }
    return true;
  }

  let moved = true;
  while (moved) {
    moved = false;
    for (let rank = 0; rank < rows.length; rank++) {
      while (tryNext(rank)) moved = true;
    }
  }
  const stuck = rows.map((actions, rank) => [rank, actions[position[rank]]]).filter(([, a]) => a);
  if (stuck.length) {
    const where = stuck.map(([rank, a]) => `rank ${rank} at ${actionText(a)}`).join(", ");
    return { deadlock: `the schedule deadlocks; no rank can move: ${where}` };
  }
  return { spans, ranks: rows.length, chunks: Math.max(...stages.map((held) => held.length)) };
}

// ---- the figures: pipeclock/observe/timeline.py, read the same way

function byStart(a, b) {
  return a.start - b.start || a.rank - b.rank || a.end - b.end;
}

function sum(values) {
  let total = 0;
  for (const value of values) total += value;
  return total;
}

/** The most activations `rank` holds at once, in stages (Timeline.peak_live / held_over_time). */
function peakHeld(spans, chunks) {
  const born = new Map();
  const freed = new Map();
  for (const s of spans) {
    const key = `${s.action.mb}.${s.action.chunk}`;
    if (s.action.op === "F") born.set(key, s.start);
    else freed.set(key, Math.max(freed.has(key) ? freed.get(key) : s.end, s.end));
  }
  const events = [];
  for (const [key, time] of born) {
    events.push([time, 1]);
    events.push([freed.has(key) ? freed.get(key) : Infinity, -1]);
  }
  events.sort((x, y) => (x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : x[1] - y[1]));
  let live = 0;
  let peak = 0;
  for (const [, change] of events) {
    live += change;
    peak = Math.max(peak, live / chunks);
  }
  return peak;
}

function figuresOf(run) {
  const spans = [...run.spans].sort(byStart);
  const start = Math.min(...spans.map((s) => s.start));
  const makespan = Math.max(...spans.map((s) => s.end)) - start;
  const perRank = [...Array(run.ranks).keys()].map((rank) => spans.filter((s) => s.rank === rank));
  const busy = perRank.map((own) => sum(own.map((s) => s.end - s.start)));
  const ideal = Math.max(...busy);
  return {
    start,
    makespan,
    bubble: makespan ? 1 - sum(busy) / (run.ranks * makespan) : 0,
    vsIdeal: ideal ? (makespan - ideal) / ideal : 0,
    peaks: perRank.map((own) => peakHeld(own, run.chunks)),
  };
}

function formulaOf(name, p, m, chunks) {
  const text = DATA.schedules[name].formula;
  const expression = text.replace(/(\d)([a-z(])/g, "$1*$2");
  return { text, value: Function("p", "m", "v", `return ${expression};`)(p, m, chunks) };
}

/** Everything the page shows of schedule `name` under `state`: its run and figures, or an error. */
function explore(name, state) {
  const chunks = chunksOf(name, state.chunks);
  const schedule = lookUp(name, state.p, state.m, chunks);
  const shown = { name, chunks, p: state.p, m: state.m };
  if (schedule.error) return { ...shown, error: schedule.error };
  const cost = {};
  for (const op of OPS) cost[op] = state[op] / chunks;
  const run = simulate(schedule, cost, state.message);
  if (run.deadlock) return { ...shown, error: run.deadlock };
  const formula = { ...formulaOf(name, state.p, state.m, chunks), caveat: schedule.caveat };
  return { ...shown, run, figures: figuresOf(run), formula };
}

// ---- the page

function number(value) {
  return Number.isInteger(value) ? String(value) : String(Number(value.toPrecision(4)));
}

/** `value` with `digits` decimals, a tie rounded to even as Python prints it (6.25 -> 6.2, not 6.3). */
function fixed(value, digits) {
  const scaled = value * 10 ** digits;
  const floor = Math.floor(scaled);
  if (scaled - floor === 0.5 && floor % 2 === 0) return (floor / 10 ** digits).toFixed(digits);
  return value.toFixed(digits);
}

function percent(share) {
  return `${fixed(100 * share, 1)}%`;
}

function element(tag, attributes = {}, text = "") {
  const made = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) made.setAttribute(name, value);
  if (text) made.textContent = text;
  return made;
}

function svgElement(tag, attributes = {}, text = "") {
  const made = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attributes)) made.setAttribute(name, value);
  if (text) made.textContent = text;
  return made;
}

function title(shown) {
  const chunks = DATA.schedules[shown.name].interleaves || shown.chunks > 1 ? `, ${shown.chunks} chunks` : "";
  return `${shown.name}: p=${shown.p}, m=${shown.m}${chunks}`;
}

function figureList(shown) {
  const f = shown.figures;
  const list = element("dl", { class: "figures" });
  const items = [
    ["makespan", number(f.makespan), f.makespan],
    ["bubble", percent(f.bubble), f.bubble],
    [`formula ${shown.formula.text}`, percent(shown.formula.value), shown.formula.value, "formula"],
    ...(shown.formula.caveat ? [["but", `the formula assumes ${shown.formula.caveat}, not so here: ` +
      "read the simulated bubble", shown.formula.caveat, "caveat"]] : []),
    ["vs ideal", `${percent(f.vsIdeal)} longer`, f.vsIdeal, "vs-ideal"],
    ["peak activations", f.peaks.map(number).join(" "), JSON.stringify(f.peaks), "peaks"],
  ];
  for (const [label, text, value, name] of items) {
    const item = element("div");
    item.append(element("dt", {}, label), element("dd", { "data-figure": name || label, "data-value": value }, text));
    list.append(item);
  }
  return list;
}

const LANE = 22;
const LEFT = 58;
const RIGHT = 70;

/** Each rank's timeline as SVG, `scale` pixels per time unit (both sides share one clock). */
function timelineSvg(shown, scale, width) {
  const { run, figures } = shown;
  const height = run.ranks * LANE + 22;
  const svg = svgElement("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "timeline" });
  for (let rank = 0; rank < run.ranks; rank++) {
    const y = rank * LANE;
    svg.append(svgElement("text", { x: 0, y: y + 15, class: "rank" }, `rank ${rank}`));
    svg.append(svgElement("rect", { x: LEFT, y: y + 2, width: figures.makespan * scale, height: LANE - 4, class: "lane" }));
    svg.append(svgElement("text", { x: width - RIGHT + 8, y: y + 15, class: "rank" }, `peak ${number(figures.peaks[rank])}`));
  }
  for (const span of run.spans) {
    const x = LEFT + (span.start - figures.start) * scale;
    const w = Math.max((span.end - span.start) * scale, 0);
    const classes = `op-${span.action.op}` + (span.action.chunk ? " later-chunk" : "");
    const rect = svgElement("rect", { x, y: span.rank * LANE + 2, width: w, height: LANE - 4, class: classes });
    const when = `${number(span.start - figures.start)} to ${number(span.end - figures.start)}`;
    rect.append(svgElement("title", {}, `${actionText(span.action)} on rank ${span.rank}: ${when}`));
    svg.append(rect);
    const label = String(span.action.mb) + (span.action.chunk ? `.${span.action.chunk}` : "");
    if (w >= 7 * label.length + 4) {
      svg.append(svgElement("text", { x: x + w / 2, y: span.rank * LANE + 15, class: "label" }, label));
    }
  }
  const axisY = run.ranks * LANE + 4;
  svg.append(svgElement("line", { x1: LEFT, x2: LEFT + figures.makespan * scale, y1: axisY, y2: axisY, class: "axis" }));
  svg.append(svgElement("text", { x: LEFT, y: axisY + 14, class: "rank" }, "0"));
  svg.append(
    svgElement("text", { x: LEFT + figures.makespan * scale, y: axisY + 14, class: "rank", "text-anchor": "end" }, number(figures.makespan)),
  );
  return svg;
}

function drawSide(section, shown, scale, width) {
  section.replaceChildren();
  if (!shown) return;
  section.dataset.schedule = shown.name;
  section.dataset.draws = String(Number(section.dataset.draws || 0) + 1);
  section.append(element("h2", {}, title(shown)));
  if (shown.error) {
    section.append(element("p", { class: "error", "data-figure": "error" }, shown.error));
    return;
  }
  section.append(figureList(shown), timelineSvg(shown, scale, width));
}

function drawTable(state) {
  const table = document.getElementById("every");
  table.replaceChildren();
  const head = element("tr");
  for (const label of ["schedule", "chunks", "makespan", "bubble", "formula", "vs ideal", "peak per rank"]) {
    head.append(element("th", {}, label));
  }
  table.append(head);
  for (const name of Object.keys(DATA.schedules)) {
    const shown = explore(name, state);
    const row = element("tr", { "data-schedule": name, "data-chunks": shown.chunks });
    if (name === state.schedule || name === state.compare) row.classList.add("shown");
    row.append(element("td", {}, name), element("td", {}, String(shown.chunks)));
    if (shown.error) {
      row.append(element("td", { colspan: 5, class: "error" }, shown.error));
    } else {
      const f = shown.figures;
      Object.assign(row.dataset, { makespan: f.makespan, bubble: f.bubble, peaks: JSON.stringify(f.peaks) });
      row.dataset.formula = shown.formula.value;
      for (const text of [number(f.makespan), percent(f.bubble), `${percent(shown.formula.value)} ${shown.formula.text}`,
        percent(f.vsIdeal), f.peaks.map(number).join(" ")]) {
        row.append(element("td", {}, text));
      }
    }
    table.append(row);
  }
}

// ---- the inputs, kept in the address's #fragment so that a view can be shared or reloaded

function stateFromHash() {
  const state = { ...DEFAULTS };
  for (const [key, value] of new URLSearchParams(location.hash.slice(1))) {
    if (key === "schedule" || key === "compare") state[key] = value;
    else if (NUMBERS.includes(key)) state[key] = Number(value);
  }
  return state;
}

function stateFromInputs() {
  const state = {};
  for (const key of ["schedule", "compare"]) state[key] = document.getElementById(key).value;
  for (const key of NUMBERS) state[key] = Number(document.getElementById(key).value);
  return state;
}

function problemWith(state) {
  if (!(state.schedule in DATA.schedules)) return `unknown schedule ${state.schedule}`;
  if (state.compare !== "none" && !(state.compare in DATA.schedules)) return `unknown schedule ${state.compare}`;
  for (const key of COUNTS) {
    if (!Number.isInteger(state[key]) || state[key] < 1) return `${key} must be a whole number >= 1`;
  }
  for (const key of [...OPS, "message"]) {
    if (!Number.isFinite(state[key]) || state[key] < 0) return `the cost of ${key} must be a number >= 0`;
  }
  if (OPS.every((op) => state[op] === 0)) return "at least one cost must be above 0";
  return "";
}

function render(state) {
  const problem = problemWith(state);
  document.getElementById("problem").textContent = problem;
  if (problem) return;
  const sides = [explore(state.schedule, state), state.compare === "none" ? null : explore(state.compare, state)];
  const width = Math.max(document.getElementById("controls").clientWidth, 640);
  const longest = Math.max(...sides.filter((s) => s && !s.error).map((s) => s.figures.makespan), 0);
  const scale = longest ? (width - LEFT - RIGHT) / longest : 0;
  drawSide(document.getElementById("side-a"), sides[0], scale, width);
  drawSide(document.getElementById("side-b"), sides[1], scale, width);
  drawTable(state);
}

function showInputs(state) {
  for (const key of ["schedule", "compare", ...NUMBERS]) document.getElementById(key).value = String(state[key]);
}

function onInput() {
  const state = stateFromInputs();
  const hash = new URLSearchParams(Object.entries(state).map(([k, v]) => [k, String(v)])).toString();
  history.replaceState(null, "", `#${hash}`);
  render(state);
}

function start() {
  for (const [id, extra] of [["schedule", []], ["compare", ["none"]]]) {
    const select = document.getElementById(id);
    for (const name of [...extra, ...Object.keys(DATA.schedules)]) select.append(element("option", { value: name }, name));
  }
  for (const id of ["p", "m", "chunks"]) {
    const limit = { p: DATA.grid.stages, m: DATA.grid.microbatches, chunks: DATA.grid.chunks }[id];
    document.getElementById(id).setAttribute("max", String(limit));
  }
  document.getElementById("controls").addEventListener("input", onInput);
  window.addEventListener("hashchange", () => {
    const state = stateFromHash();
    showInputs(state);
    render(state);
  });
  const state = stateFromHash();
  showInputs(state);
  render(state);
  document.body.dataset.ready = "true";
}

start();
