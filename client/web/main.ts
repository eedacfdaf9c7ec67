// The tokenline page: streams a completion over gRPC-Web from the server that serves this page, with
// the latencies a person feels measured here (first token, each gap, total) beside the server's own
// split of the same request from its final chunk.
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";
import type { MessageInitShape } from "@bufbuild/protobuf";
import {
  FinishReason,
  type GenerateRequestSchema,
  type PositionLogprobs,
  type Timeline,
  Tokenline,
  TrafficClass,
} from "../../build/gen-js/web/tokenline/v1/tokenline_pb";

const client = createClient(Tokenline, createGrpcWebTransport({ baseUrl: location.origin, useBinaryFormat: true }));

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;
const ui = {
  form: $<HTMLFormElement>("ask"), model: $<HTMLSelectElement>("model"), cls: $<HTMLSelectElement>("traffic-class"),
  maxTokens: $<HTMLInputElement>("max-tokens"), temperature: $<HTMLInputElement>("temperature"),
  deadline: $<HTMLInputElement>("deadline"), apiKey: $<HTMLInputElement>("api-key"), chat: $<HTMLInputElement>("chat"),
  ignoreEos: $<HTMLInputElement>("ignore-eos"), logprobs: $<HTMLInputElement>("logprobs"),
  jsonSchema: $<HTMLInputElement>("json-schema"),
  prompt: $<HTMLTextAreaElement>("prompt"), send: $<HTMLButtonElement>("send"), cancel: $<HTMLButtonElement>("cancel"),
  status: $("status"), connection: $("connection"), output: $("output"), chart: $<HTMLCanvasElement>("gaps"),
};

/** What one request measured in the browser; times are performance.now() milliseconds. */
class Measurement {
  readonly start = performance.now();
  firstToken?: number;
  last?: number;
  end?: number;
  tokens = 0;
  readonly gaps: number[] = []; // before each chunk that carried tokens, after the first

  onTokens(count: number): void {
    const now = performance.now();
    if (this.firstToken === undefined) this.firstToken = now;
    else if (this.last !== undefined) this.gaps.push(now - this.last);
    this.last = now;
    this.tokens += count;
  }

  percentile(q: number): number | undefined {
    if (!this.gaps.length) return undefined;
    const sorted = [...this.gaps].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
  }
}

let running: { id: string; abort: AbortController; measure: Measurement } | null = null;

function authHeaders(): HeadersInit {
  const key = ui.apiKey.value.trim();
  return key ? { authorization: `Bearer ${key}` } : {};
}

function describe(err: unknown): string {
  if (err instanceof ConnectError) return `${Code[err.code]}: ${err.rawMessage}`;
  return String(err);
}

const ms = (v: number | undefined) => (v === undefined ? "–" : v < 10 ? `${v.toFixed(1)} ms` : `${Math.round(v)} ms`);
const set = (id: string, text: string) => { $(id).textContent = text; };

function setState(state: "ready" | "streaming" | "done" | "cancelled" | "error", status = ""): void {
  document.body.dataset.state = state;
  ui.status.textContent = status;
  ui.send.disabled = state === "streaming";
  ui.cancel.disabled = state !== "streaming";
}

async function loadModels(): Promise<void> {
  try {
    const reply = await client.listModels({}, { headers: authHeaders(), timeoutMs: 10_000 });
    ui.model.replaceChildren(...reply.models.map((m) => {
      const option = new Option(`${m.name}${m.loaded ? "" : " (loading)"}`, m.name);
      option.title = `version ${m.version}, context ${m.maxContext} tokens, ${m.workers} worker(s)`;
      return option;
    }));
    ui.connection.textContent = `${location.host} · ${reply.models.length} model(s)`;
    setState("ready");
  } catch (err) {
    ui.connection.textContent = `cannot list models: ${describe(err)}`;
    setState("error", describe(err));
  }
}

/** A chunk's text as one span whose tooltip lists each token's log-probability and its alternatives. */
function showTokens(count: number, text: string, logprobs: readonly PositionLogprobs[]): void {
  const span = document.createElement("span");
  span.className = "token";
  span.textContent = text;
  span.title = logprobs.map((p) => `${JSON.stringify(p.token?.text ?? "")} ${p.token?.logprob.toFixed(3)} · `
    + p.top.map((t) => `${JSON.stringify(t.text)} ${t.logprob.toFixed(2)}`).join(", ")).join("\n");
  const own = logprobs.reduce((sum, p) => sum + (p.token?.logprob ?? 0), 0) / Math.max(count, 1);
  span.style.opacity = String(0.45 + 0.55 * Math.exp(own));  // a likely token shows solid, an unlikely one faint
  ui.output.append(span);
}

function request(id: string): MessageInitShape<typeof GenerateRequestSchema> {
  const text = ui.prompt.value;
  const init: MessageInitShape<typeof GenerateRequestSchema> = {
    model: ui.model.value,
    requestId: id,
    trafficClass: ui.cls.value === "bulk" ? TrafficClass.BULK : TrafficClass.INTERACTIVE,
    sampling: {
      maxTokens: Number(ui.maxTokens.value) || 64, temperature: Number(ui.temperature.value), ignoreEos: ui.ignoreEos.checked,
      ...(ui.logprobs.checked ? { logprobs: 3 } : {}),
      ...(ui.jsonSchema.value.trim() ? { structuredOutput: { format: { case: "jsonSchema", value: ui.jsonSchema.value } } } : {}),
    },
    prompt: ui.chat.checked
      ? { case: "chat", value: { messages: [{ role: "user", content: text }] } }
      : { case: "text", value: text },
  };
  return init;
}

async function generate(): Promise<void> {
  const id = crypto.randomUUID();
  const abort = new AbortController();
  const measure = new Measurement();
  running = { id, abort, measure };
  ui.output.textContent = "";
  ui.output.classList.remove("cancelled");
  showBrowser(measure);
  showServer(undefined, FinishReason.FINISH_REASON_UNSPECIFIED);
  setState("streaming", "waiting for the first token…");
  let finish = FinishReason.FINISH_REASON_UNSPECIFIED;
  try {
    const stream = client.generate(request(id), {
      headers: authHeaders(), signal: abort.signal, timeoutMs: (Number(ui.deadline.value) || 120) * 1000,
    });
    for await (const chunk of stream) {
      if (chunk.tokenIds.length) measure.onTokens(chunk.tokenIds.length);
      if (chunk.logprobs.length) showTokens(chunk.tokenIds.length, chunk.text, chunk.logprobs);
      else if (chunk.text) ui.output.append(chunk.text);
      if (chunk.finishReason !== FinishReason.FINISH_REASON_UNSPECIFIED) {
        finish = chunk.finishReason;
        showServer(chunk.timeline, finish);
      }
      showBrowser(measure);
      if (measure.firstToken !== undefined) ui.status.textContent = "streaming…";
    }
    measure.end = performance.now();
    showBrowser(measure);
    if (finish === FinishReason.CANCELLED) {
      ui.output.classList.add("cancelled");
      setState("cancelled", "cancelled: the server stopped the request");
    } else {
      setState("done", `done: ${FinishReason[finish].toLowerCase()}`);
    }
  } catch (err) {
    measure.end = performance.now();
    showBrowser(measure);
    if (abort.signal.aborted) {
      ui.output.classList.add("cancelled");
      setState("cancelled", "cancelled: the stream was closed");
    } else {
      setState("error", describe(err));
    }
  } finally {
    running = null;
  }
}

/** Ask the server to stop the request (its stream then ends with finish reason CANCELLED); if it
 * does not know the request (still being tokenized, or already done), close the stream instead. */
async function cancel(): Promise<void> {
  const current = running;
  if (!current) return;
  ui.cancel.disabled = true;
  ui.status.textContent = "cancelling…";
  try {
    const reply = await client.cancel({ requestId: current.id }, { headers: authHeaders(), timeoutMs: 10_000 });
    if (!reply.cancelled) current.abort.abort();
  } catch (err) {
    if (!(err instanceof ConnectError && err.code === Code.NotFound)) ui.status.textContent = describe(err);
    current.abort.abort();
  }
}

function showBrowser(m: Measurement): void {
  const end = m.end ?? m.last;
  set("ttft", ms(m.firstToken === undefined ? undefined : m.firstToken - m.start));
  const p50 = m.percentile(0.5);
  set("itl", p50 === undefined ? "–" : `${ms(p50)} / ${ms(Math.max(...m.gaps))}`);
  set("last-gap", ms(m.gaps.at(-1)));
  set("total", ms(end === undefined ? undefined : end - m.start));
  const seconds = m.firstToken !== undefined && m.last !== undefined && m.last > m.firstToken ? (m.last - m.firstToken) / 1000 : 0;
  set("tokens", m.tokens ? `${m.tokens}${seconds ? ` · ${((m.tokens - 1) / seconds).toFixed(1)} tok/s` : ""}` : "–");
  drawGaps(m.gaps);
}

const SPLIT = [
  ["admission", "s-admission", (t: Timeline) => t.admissionWaitMs],
  ["queueing", "s-queueing", (t: Timeline) => t.queueingMs],
  ["prefill", "s-prefill", (t: Timeline) => t.prefillMs],
  ["decode", "s-decode", (t: Timeline) => t.decodeMs],
  ["return", "s-return", (t: Timeline) => t.returnMs],
] as const;

function showServer(t: Timeline | undefined, finish: FinishReason): void {
  const bar = $("split-bar");
  bar.replaceChildren();
  for (const [key, id, read] of SPLIT) set(id, t ? ms(read(t)) : "–");
  set("s-ttft", t ? `${ms(t.ttftMs)} / ${ms(t.itlMeanMs)}` : "–");
  set("s-total", t ? ms(t.completionMs) : "–");
  set("finish", finish === FinishReason.FINISH_REASON_UNSPECIFIED ? "–" : FinishReason[finish].toLowerCase());
  if (!t) return;
  const total = SPLIT.reduce((sum, [, , read]) => sum + read(t), 0) || 1;
  for (const [key, , read] of SPLIT) {
    const part = document.createElement("span");
    part.className = key;
    part.style.width = `${(100 * read(t)) / total}%`;
    part.title = `${key} ${ms(read(t))}`;
    bar.append(part);
  }
}

let drawPending = false;
function drawGaps(gaps: number[]): void {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    const canvas = ui.chart;
    const scale = window.devicePixelRatio || 1;
    const width = canvas.clientWidth * scale, height = canvas.clientHeight * scale;
    canvas.width = width;
    canvas.height = height;
    const g = canvas.getContext("2d")!;
    g.clearRect(0, 0, width, height);
    if (!gaps.length) return;
    const shown = gaps.slice(-200);
    const top = Math.max(...shown) * 1.1 || 1;
    const x = (i: number) => (shown.length === 1 ? width / 2 : (i / (shown.length - 1)) * (width - 4) + 2);
    const y = (v: number) => height - 4 - (v / top) * (height - 16);
    g.strokeStyle = "#2f6fdf";
    g.lineWidth = 1.5 * scale;
    g.beginPath();
    shown.forEach((v, i) => (i ? g.lineTo(x(i), y(v)) : g.moveTo(x(i), y(v))));
    g.stroke();
    g.fillStyle = "#6b7483";
    g.font = `${11 * scale}px system-ui, sans-serif`;
    g.fillText(`gap per token, max ${ms(top / 1.1)}`, 4, 12 * scale);
  });
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  if (!running) void generate();
});
ui.cancel.addEventListener("click", () => void cancel());
ui.apiKey.addEventListener("change", () => void loadModels());
void loadModels();
