// Drives Baton's page in Debian's Chromium (playwright-core, no downloaded browser): enters the API key, sends a chat
// message and watches the reply stream in, stops a second reply, then reads the cluster view and saves a screenshot.
// Usage: node tests/js/web.mjs URL [--key KEY] [--shot FILE]. Prints one JSON line of what it saw; exits non-zero on
// failure. Every wait is bounded.
import { chromium } from 'playwright-core';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const args = process.argv.slice(2);
const url = args[0];
const opt = (name) => { const i = args.indexOf(name); return i >= 0 ? args[i + 1] : undefined; };
const key = opt('--key');
const shot = opt('--shot');
const WAIT = 120_000;

function check(cond, what) {
  if (!cond) throw new Error('check failed: ' + what);
}

const profile = mkdtempSync(join(tmpdir(), 'baton-web-'));
const ctx = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  viewport: { width: 1280, height: 900 },
  timeout: 60_000,
});
let failed = null;
const seen = {};
try {
  const page = ctx.pages()[0] || await ctx.newPage();
  page.setDefaultTimeout(WAIT);
  const external = [];
  page.on('request', (r) => { if (!r.url().startsWith(url)) external.push(r.url()); });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(url);
  if (key) {
    await page.waitForSelector('#alert:not([hidden])');
    seen.asked_for_key = (await page.textContent('#alert')).includes('API key');
    await page.fill('#api-key', key);
    await page.click('#key-form button');
  }
  await page.waitForFunction(() => !document.getElementById('model-line').textContent.includes('connecting'));
  seen.model_line = await page.textContent('#model-line');

  // A reply that streams: text is visible while the message is still marked as streaming.
  await page.fill('#max-tokens', '40');
  await page.fill('#temperature', '0');
  await page.fill('#prompt', 'Name three colours.');
  await page.click('#send');
  await page.waitForFunction(() => {
    const m = document.querySelector('.msg.assistant.streaming .text');
    return m && m.textContent.length > 0;
  });
  seen.partial = await page.textContent('.msg.assistant.streaming .text').catch(() => '');
  await page.waitForSelector('.msg.assistant.done');
  seen.reply = await page.textContent('.msg.assistant.done .text');
  seen.stats = await page.textContent('.msg.assistant.done .stats');
  check(seen.reply.trim().length > 0, 'a reply');
  check(/TTFT \d+ ms/.test(seen.stats) && /tok\/s/.test(seen.stats), 'TTFT and tok/s under the reply: ' + seen.stats);

  // Stop a long reply midway: the page says so, and the server records the request as cancelled.
  await page.fill('#max-tokens', '300');
  await page.fill('#prompt', 'Write a long story about a lighthouse keeper.');
  await page.click('#send');
  await page.waitForFunction(() => {
    const m = document.querySelectorAll('.msg.assistant')[1];
    return m && m.querySelector('.text').textContent.length > 0;
  });
  await page.click('#stop');
  await page.waitForFunction(() => document.querySelectorAll('.msg.assistant.done').length === 2);
  seen.stopped_stats = await page.textContent('.msg.assistant.done >> nth=1 >> .stats');
  check(seen.stopped_stats.includes('stopped'), 'the stopped reply says so: ' + seen.stopped_stats);
  seen.cancelled_on_server = await page.evaluate(async (k) => {
    const h = k ? { Authorization: 'Bearer ' + k } : {};
    for (let i = 0; i < 100; i++) {
      const c = await (await fetch('/v1/cluster', { headers: h })).json();
      if (c.requests.some((r) => r.finish === 'cancelled')) return c.requests.find((r) => r.finish === 'cancelled');
      await new Promise((r) => setTimeout(r, 200));
    }
    return null;
  }, key);
  check(seen.cancelled_on_server && seen.cancelled_on_server.completion_tokens < 300, 'the server stopped generating');

  // The cluster view.
  await page.click('#tab-cluster');
  await page.waitForFunction(() => document.querySelectorAll('#requests tbody tr').length >= 2);
  const rows = async (sel) => page.$$eval(sel + ' tbody tr', (trs) => trs.map((tr) => [...tr.cells].map((c) => c.textContent)));
  seen.nodes = await rows('#nodes');
  seen.links = await rows('#links');
  seen.requests = await rows('#requests');
  check(seen.nodes.length >= 2, 'two nodes in the cluster view');
  seen.external_requests = external;
  seen.page_errors = errors;
  check(external.length === 0, 'no request left the server: ' + external.join(' '));
  check(errors.length === 0, 'no script errors: ' + errors.join(' '));
  if (shot) await page.screenshot({ path: shot, fullPage: true });
} catch (e) {
  failed = e;
} finally {
  await ctx.close().catch(() => {});
  rmSync(profile, { recursive: true, force: true });
}
console.log(JSON.stringify(seen));
if (failed) {
  console.error(String(failed && failed.stack || failed));
  process.exit(1);
}
