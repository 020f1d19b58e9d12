// Driven by tests/grammar.rs: a forced tool call (plain and streamed) and a JSON-schema reply through the official
// `openai` JS client. Args: base URL, tools as JSON.
import OpenAI from "openai";
import assert from "node:assert/strict";

const [base, toolsJson] = process.argv.slice(2);
const c = new OpenAI({ baseURL: base + "/v1", apiKey: "k", maxRetries: 0, timeout: 120000 });
const tools = JSON.parse(toolsJson);
const messages = [{ role: "user", content: "Weather in Oslo?" }];

const r = await c.chat.completions.create({ model: "smollm2", messages, tools, tool_choice: "required",
  max_tokens: 80, temperature: 0 });
assert.equal(r.choices[0].finish_reason, "tool_calls");
const call = r.choices[0].message.tool_calls[0];
assert.equal(call.type, "function");
assert.ok(call.id.startsWith("call_"));
const args = JSON.parse(call.function.arguments);
console.log("CALL", call.function.name, JSON.stringify(args));

// The stream helper accumulates tool-call deltas into the final message.
const stream = c.chat.completions.stream({ model: "smollm2", messages, tools, tool_choice: "required",
  max_tokens: 80, temperature: 0 });
const done = await stream.finalChatCompletion();
const sc = done.choices[0].message.tool_calls[0];
assert.equal(sc.function.name, call.function.name);
assert.deepEqual(JSON.parse(sc.function.arguments), args);

const schema = { type: "object", properties: { city: { type: "string", maxLength: 20 }, sunny: { type: "boolean" } },
  required: ["city", "sunny"], additionalProperties: false };
const j = await c.chat.completions.create({ model: "smollm2", messages: [{ role: "user", content: "Is it sunny in Rome?" }],
  response_format: { type: "json_schema", json_schema: { name: "w", schema, strict: true } }, max_tokens: 60,
  temperature: 0 });
const v = JSON.parse(j.choices[0].message.content);
assert.deepEqual(Object.keys(v).sort(), ["city", "sunny"]);
assert.equal(typeof v.sunny, "boolean");
console.log("ok");
