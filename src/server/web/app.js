// Baton's page: a chat over /v1/chat/completions (streamed) and a view of /v1/cluster. No framework, no build step;
// every value from the server is written as text (textContent), never as markup.
'use strict';

const $ = (id) => document.getElementById(id);
const KEY = 'baton.apiKey';
const history = [];
let modelId = null;
let running = null; // the AbortController of the reply being streamed

function headers() {
  const h = { 'Content-Type': 'application/json' };
  const k = localStorage.getItem(KEY);
  if (k) h.Authorization = 'Bearer ' + k;
  return h;
}

function alertText(text) {
  const a = $('alert');
  a.textContent = text || '';
  a.hidden = !text;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

// --- tabs and key ---

for (const t of document.querySelectorAll('.tab')) {
  t.addEventListener('click', () => show(t.dataset.view));
}

function show(view) {
  for (const t of document.querySelectorAll('.tab')) t.classList.toggle('active', t.dataset.view === view);
  $('view-chat').hidden = view !== 'chat';
  $('view-cluster').hidden = view !== 'cluster';
  if (view === 'cluster') refresh();
}

$('api-key').value = localStorage.getItem(KEY) || '';
$('key-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const k = $('api-key').value.trim();
  if (k) localStorage.setItem(KEY, k); else localStorage.removeItem(KEY);
  refresh();
});

// --- chat ---

function addMessage(role, text) {
  const m = el('div', 'msg ' + role);
  const body = el('span', 'text', text);
  m.appendChild(body);
  $('messages').appendChild(m);
  m.scrollIntoView({ block: 'end' });
  return m;
}

async function apiError(resp) {
  try {
    const j = await resp.json();
    if (j && j.error && j.error.message) return `${resp.status}: ${j.error.message}`;
  } catch (_) { /* not JSON */ }
  return `HTTP ${resp.status}`;
}

async function send(text) {
  history.push({ role: 'user', content: text });
  addMessage('user', text);
  const m = addMessage('assistant', '');
  m.classList.add('streaming');
  const body = m.querySelector('.text');
  const stats = el('span', 'stats', 'waiting…');
  m.appendChild(stats);
  const ctl = new AbortController();
  running = ctl;
  $('send').disabled = true;
  $('stop').disabled = false;
  const t0 = performance.now();
  let tFirst = null, tLast = null, pieces = 0, usage = null, finish = null, reply = '';
  try {
    const resp = await fetch('/v1/chat/completions', {
      method: 'POST', headers: headers(), signal: ctl.signal,
      body: JSON.stringify({
        model: modelId || undefined, messages: history, stream: true, stream_options: { include_usage: true },
        max_tokens: Number($('max-tokens').value) || undefined, temperature: Number($('temperature').value),
      }),
    });
    if (!resp.ok) throw new Error(await apiError(resp));
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf('\n\n')) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data:')) continue;
          const data = line.slice(5).trim();
          if (data === '[DONE]') continue;
          const j = JSON.parse(data);
          if (j.error) throw new Error(j.error.message || 'the server reported an error');
          if (j.usage) usage = j.usage;
          const c = j.choices && j.choices[0];
          if (!c) continue;
          if (c.finish_reason) finish = c.finish_reason;
          const d = c.delta && c.delta.content;
          if (d) {
            const now = performance.now();
            if (tFirst === null) tFirst = now;
            tLast = now;
            pieces++;
            reply += d;
            body.textContent = reply;
            stats.textContent = `${pieces} pieces · TTFT ${(tFirst - t0).toFixed(0)} ms`;
            m.scrollIntoView({ block: 'end' });
          }
        }
      }
    }
  } catch (e) {
    if (e.name === 'AbortError') finish = 'stopped';
    else { m.classList.add('error'); body.textContent = reply + (reply ? '\n' : '') + 'Error: ' + e.message; }
  } finally {
    running = null;
    $('send').disabled = false;
    $('stop').disabled = true;
    m.classList.remove('streaming');
  }
  if (reply) history.push({ role: 'assistant', content: reply });
  const n = usage ? usage.completion_tokens : pieces;
  const parts = [`${n} tokens`];
  if (tFirst !== null) parts.push(`TTFT ${(tFirst - t0).toFixed(0)} ms`);
  if (tFirst !== null && n > 1 && tLast > tFirst) parts.push(`${((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tok/s`);
  if (finish) parts.push(finish);
  stats.textContent = parts.join(' · ');
  m.classList.add('done');
}

$('chat-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const text = $('prompt').value.trim();
  if (!text || running) return;
  $('prompt').value = '';
  send(text);
});
$('prompt').addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey) { e.preventDefault(); $('chat-form').requestSubmit(); }
});
$('stop').addEventListener('click', () => { if (running) running.abort(); });
$('clear').addEventListener('click', () => { history.length = 0; $('messages').replaceChildren(); });

// --- cluster ---

function bytes(n) {
  if (n === null || n === undefined) return '–';
  const u = ['B', 'KB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}
const ms = (v) => (v === null || v === undefined ? '–' : `${v.toFixed(0)} ms`);
const rate = (v) => (v === null || v === undefined ? '–' : v.toFixed(1));

function row(cells) {
  const tr = document.createElement('tr');
  for (const c of cells) {
    if (c instanceof Node) { const td = el('td'); td.appendChild(c); tr.appendChild(td); continue; }
    const [text, cls] = Array.isArray(c) ? c : [c, ''];
    tr.appendChild(el('td', cls, text === null || text === undefined ? '–' : text));
  }
  return tr;
}

function splitBar(r) {
  const wrap = el('div');
  const total = r.ttft_ms || 0;
  const bar = el('div', 'bar');
  const part = (cls, v, what) => {
    const s = el('span', cls);
    s.style.width = total > 0 ? `${Math.max(0, (100 * (v || 0)) / total)}%` : '0';
    s.title = `${what} ${ms(v)}`;
    bar.appendChild(s);
  };
  part('q', r.queue_ms, 'queue');
  part('p', r.prefill_ms, 'prefill');
  part('f', r.first_token_ms, 'first token');
  wrap.appendChild(bar);
  wrap.appendChild(el('div', 'split', `${ms(r.queue_ms)} · ${ms(r.prefill_ms)} · ${ms(r.first_token_ms)}`));
  return wrap;
}

function render(c) {
  modelId = c.model;
  const remote = c.nodes.filter((n) => n.addr).length;
  $('model-line').textContent = `${c.model} — ${c.generator} — ${c.nodes.length} node(s), ${remote} remote`;
  $('cluster-summary').textContent =
    `up ${Math.round(c.uptime_s)} s · ${c.queued} queued · ${c.requests.length} recent request(s)`;
  $('nodes').tBodies[0].replaceChildren(...c.nodes.map((n) => row([
    n.name, n.role, n.layers, n.addr || 'this server', n.backend, n.isa,
    n.up === null ? ['unchecked', ''] : n.up ? ['up', 'up'] : ['down', 'down'],
    [n.slots ? `${n.busy} / ${n.slots}` : '–', 'num'], [rate(n.tok_s), 'num'], [n.tokens, 'num'],
  ])));
  $('links').tBodies[0].replaceChildren(...c.links.map((l) => row([
    l.a, l.b, [bytes(l.bytes_ab), 'num'], [bytes(l.bytes_ba), 'num'], [bytes(l.bytes_per_s) + '/s', 'num'],
    [l.throughput ? bytes(l.throughput) + '/s' : '–', 'num'],
  ])));
  $('requests').tBodies[0].replaceChildren(...c.requests.map((r) => row([
    [r.id, 'num'], r.prefill, r.decode, [r.prompt_tokens + (r.cached_tokens ? ` (${r.cached_tokens} cached)` : ''), 'num'],
    [r.completion_tokens, 'num'], [ms(r.ttft_ms), 'num'], splitBar(r), [rate(r.tok_s), 'num'], r.finish,
  ])));
}

async function refresh() {
  try {
    const resp = await fetch('/v1/cluster', { headers: headers() });
    if (resp.status === 401) { alertText('This server needs an API key: enter it above.'); return; }
    if (!resp.ok) { alertText('cluster: ' + (await apiError(resp))); return; }
    alertText('');
    render(await resp.json());
  } catch (e) {
    alertText('cannot reach the server: ' + e.message);
  }
}

refresh();
setInterval(() => { if (!document.hidden && (!$('view-cluster').hidden || !modelId)) refresh(); }, 1000);
