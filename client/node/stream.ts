// A Node service calling tokenline with its generated @grpc/grpc-js stub (ts-proto, built by `make web`):
// stream one completion, pass the text on as it comes, and report what a caller feels: time to first
// token, the gaps between tokens (p50 and max) and the total time, beside the server's own split.
//
//   node build/node/stream.cjs --target 127.0.0.1:50051 --max-tokens 64 "Write a haiku about the sea."
//   TOKENLINE_API_KEY=... node build/node/stream.cjs --json "Hello"   # one JSON line of figures at the end
//   node build/node/stream.cjs --json-schema person.json --logprobs 3 "Describe a person as JSON"
import { credentials, Metadata, status as Status, type ServiceError } from "@grpc/grpc-js";
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import {
  FinishReason,
  finishReasonToJSON,
  GenerateRequest,
  type Timeline,
  TokenlineClient,
  TrafficClass,
} from "../../build/gen-js/node/tokenline/v1/tokenline";

export interface StreamFigures {
  ttftMs: number | null;
  itlP50Ms: number | null;
  itlMaxMs: number | null;
  totalMs: number;
  tokens: number;
  finish: string;
  server: Timeline | undefined;
  /** With sampling.logprobs: each token's own log-probability and its alternatives, in order. */
  logprobs: { tokenId: number; logprob: number; text: string; top: { tokenId: number; logprob: number; text: string }[] }[];
}

/** Streams one completion, calling `onText` with each piece; resolves with the measured figures. */
export function streamCompletion(client: TokenlineClient, request: GenerateRequest, onText: (text: string) => void,
                                 options: { apiKey?: string; deadlineS?: number } = {}): Promise<StreamFigures> {
  const metadata = new Metadata();
  if (options.apiKey) metadata.set("authorization", `Bearer ${options.apiKey}`);
  const start = performance.now();
  let first: number | null = null;
  let last: number | null = null;
  let tokens = 0;
  const gaps: number[] = [];
  let finish = FinishReason.FINISH_REASON_UNSPECIFIED;
  let server: Timeline | undefined;
  const logprobs: StreamFigures["logprobs"] = [];
  return new Promise((resolve, reject) => {
    const call = client.generate(request, metadata, { deadline: Date.now() + (options.deadlineS ?? 120) * 1000 });
    call.on("data", (chunk) => {
      const now = performance.now();
      if (chunk.tokenIds.length) {
        if (first === null) first = now;
        else if (last !== null) gaps.push(now - last);
        last = now;
        tokens += chunk.tokenIds.length;
      }
      if (chunk.text) onText(chunk.text);
      for (const p of chunk.logprobs) {
        const own = p.token!;
        logprobs.push({ tokenId: own.tokenId, logprob: own.logprob, text: own.text,
                        top: p.top.map((t) => ({ tokenId: t.tokenId, logprob: t.logprob, text: t.text })) });
      }
      if (chunk.finishReason !== FinishReason.FINISH_REASON_UNSPECIFIED) {
        finish = chunk.finishReason;
        server = chunk.timeline;
      }
    });
    call.on("error", reject);
    call.on("end", () => {
      const sorted = [...gaps].sort((a, b) => a - b);
      resolve({
        ttftMs: first === null ? null : first - start,
        itlP50Ms: sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor(sorted.length / 2))] : null,
        itlMaxMs: sorted.length ? sorted[sorted.length - 1] : null,
        totalMs: performance.now() - start,
        tokens,
        finish: finishReasonToJSON(finish).toLowerCase(),
        server,
        logprobs,
      });
    });
  });
}

const fmt = (v: number | null | undefined) => (v === null || v === undefined ? "-" : v.toFixed(1));

async function main(): Promise<number> {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      target: { type: "string", default: "127.0.0.1:50051" },
      model: { type: "string", default: "" },
      "max-tokens": { type: "string", default: "64" },
      temperature: { type: "string", default: "0.7" },
      class: { type: "string", default: "interactive" },
      "deadline-s": { type: "string", default: "120" },
      text: { type: "boolean", default: false },
      "ignore-eos": { type: "boolean", default: false },
      json: { type: "boolean", default: false },
      logprobs: { type: "string" },
      "json-schema": { type: "string" },
      regex: { type: "string" },
      help: { type: "boolean", default: false },
    },
  });
  if (values.help || !positionals.length) {
    console.log("usage: node build/node/stream.cjs [--target HOST:PORT] [--model NAME] [--max-tokens N] [--temperature T]\n"
      + "                                 [--class interactive|bulk] [--text] [--ignore-eos] [--json]\n"
      + "                                 [--logprobs K] [--json-schema FILE | --regex RE] PROMPT\n"
      + "  the API key, if the server wants one, comes from $TOKENLINE_API_KEY");
    return values.help ? 0 : 2;
  }
  const prompt = positionals.join(" ");
  const request = GenerateRequest.fromPartial({
    model: values.model,
    ...(values.text ? { text: prompt } : { chat: { messages: [{ role: "user", content: prompt }] } }),
    sampling: {
      maxTokens: Number(values["max-tokens"]), temperature: Number(values.temperature), ignoreEos: values["ignore-eos"],
      ...(values.logprobs !== undefined ? { logprobs: Number(values.logprobs) } : {}),
      ...(values["json-schema"] ? { structuredOutput: { jsonSchema: readFileSync(values["json-schema"], "utf8") } }
        : values.regex ? { structuredOutput: { regex: values.regex } } : {}),
    },
    trafficClass: values.class === "bulk" ? TrafficClass.BULK : TrafficClass.INTERACTIVE,
  });
  const client = new TokenlineClient(values.target!, credentials.createInsecure());
  try {
    const figures = await streamCompletion(client, request, (text) => process.stdout.write(text), {
      apiKey: process.env.TOKENLINE_API_KEY, deadlineS: Number(values["deadline-s"]),
    });
    process.stdout.write("\n");
    const s = figures.server;
    console.log(`ttft ${fmt(figures.ttftMs)} ms · itl p50 ${fmt(figures.itlP50Ms)} ms, max ${fmt(figures.itlMaxMs)} ms · `
      + `total ${fmt(figures.totalMs)} ms · ${figures.tokens} tokens · ${figures.finish}`);
    if (s) {
      console.log(`server: admission wait ${fmt(s.admissionWaitMs)} · queueing ${fmt(s.queueingMs)} · prefill ${fmt(s.prefillMs)}`
        + ` · decode ${fmt(s.decodeMs)} · return ${fmt(s.returnMs)} ms`);
    }
    if (values.json) console.log(JSON.stringify(figures));
    return 0;
  } catch (err) {
    const e = err as ServiceError;
    console.error(`tokenline: ${Status[e.code] ?? "error"}: ${e.details ?? e.message}`);
    return 1;
  } finally {
    client.close();
  }
}

if (require.main === module) {
  main().then((code) => { process.exitCode = code; });
}
