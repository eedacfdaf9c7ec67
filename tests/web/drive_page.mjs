// Drives the tokenline page in headless Chromium (Debian's chromium, through playwright-core) and
// prints one JSON line of what it saw; tests/test_web.py makes the assertions.
//
//   node tests/web/drive_page.mjs URL SCREENSHOT.png [--api-key KEY] [--max-tokens N] [--prompt TEXT]
//                                 [--no-cancel] [--stop-at-eos] [--chromium /usr/bin/chromium]
// Steps: open the page, wait for the model list, stream a completion to its end (screenshot), then
// start a long one and cancel it after its first tokens.
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { chromium } from "playwright-core";

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    "api-key": { type: "string", default: "" },
    "max-tokens": { type: "string", default: "24" },
    prompt: { type: "string", default: "" },
    "no-cancel": { type: "boolean", default: false },
    "stop-at-eos": { type: "boolean", default: false },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    timeout: { type: "string", default: "180" },
  },
});
const [url, screenshot] = positionals;
const timeout = Number(values.timeout) * 1000;
// On a machine without outside network Chromium hangs in its background services unless told not to start them.
const flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"];
const profile = mkdtempSync(join(tmpdir(), "tokenline-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: values.chromium, headless: true, args: flags, viewport: { width: 1280, height: 820 }, timeout: 60_000,
});
const result = { console: [] };
try {
  const page = context.pages()[0] ?? await context.newPage();
  page.on("console", (m) => { if (m.type() === "error") result.console.push(m.text()); });
  page.setDefaultTimeout(timeout);
  await page.goto(url);
  if (values["api-key"]) {
    await page.fill("#api-key", values["api-key"]);
    await page.dispatchEvent("#api-key", "change");
  }
  await page.waitForSelector("body[data-state=ready]");
  result.models = await page.$$eval("#model option", (os) => os.map((o) => o.value));

  const read = () => page.evaluate(() => {
    const text = (id) => document.getElementById(id).textContent;
    return {
      state: document.body.dataset.state, status: text("status"), output: text("output"),
      ttft: text("ttft"), itl: text("itl"), total: text("total"), tokens: text("tokens"), finish: text("finish"),
      split: Object.fromEntries(["admission", "queueing", "prefill", "decode", "return"].map((k) => [k, text(`s-${k}`)])),
      serverTtft: text("s-ttft"), serverTotal: text("s-total"),
      splitBars: document.querySelectorAll("#split-bar span").length,
      chartInk: (() => { // the chart drew something: some canvas pixel is not blank
        const c = document.getElementById("gaps");
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        for (let i = 3; i < d.length; i += 4) if (d[i]) return true;
        return false;
      })(),
    };
  });

  // 1. A whole completion.
  if (values.prompt) await page.fill("#prompt", values.prompt);
  await page.fill("#max-tokens", values["max-tokens"]);
  await page.fill("#temperature", "0");
  if (!values["stop-at-eos"]) await page.check("#ignore-eos");
  await page.check("#logprobs");
  await page.click("#send");
  await page.waitForSelector("body[data-state=done], body[data-state=error]");
  await page.waitForTimeout(100); // let the chart's animation frame run
  result.complete = await read();
  // With logprobs, each chunk's text is a span whose tooltip gives its tokens' log-probabilities.
  result.complete.tokenTitles = await page.$$eval("#output span.token", (ss) => ss.map((s) => s.title));
  await page.uncheck("#logprobs");
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });

  // 2. Cancel mid-stream: a long completion, cancelled once tokens are arriving.
  if (!values["no-cancel"]) {
    await page.fill("#max-tokens", "1500");
    await page.click("#send");
    await page.waitForFunction(() => parseInt(document.getElementById("tokens").textContent) >= 3);
    result.beforeCancel = await read();
    await page.click("#cancel");
    await page.waitForSelector("body[data-state=cancelled], body[data-state=done], body[data-state=error]");
    result.cancelled = await read();
  }
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
console.log(JSON.stringify(result));
