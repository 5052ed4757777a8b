#!/usr/bin/env node
// An OpenAI-style HTTP client as a Node.js application would write one without the SDK: the global
// `fetch` and a hand-written Server-Sent Events reader. It streams one completion and prints ONE JSON
// line on stdout so a test in another language can assert on it.
//
//   node openai_stream.mjs --base-url http://HOST:PORT/v1 --endpoint chat|completion \
//        --body '<request body JSON>' [--timeout-ms N]
//
// The body is sent as given, plus `stream: true` and `stream_options.include_usage` (the usage comes
// in a last event with no choices). Prints {"text", "finish_reason", "usage", "events"}: the text is
// every choice 0 delta joined (`delta.content` for chat, `text` for completion). An HTTP error status
// prints {"error": {"status", "body"}} and exits 0 (the caller asserts on it). A broken stream (an
// event that is not JSON, no `data: [DONE]` at the end, anything after it) exits 3; a bad invocation 64.

import { parseArgs } from 'node:util';

import { ProtocolError, UsageError, printResult } from './cli_result.mjs';

const PATHS = { chat: '/chat/completions', completion: '/completions' };

function parseCli(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      'base-url': { type: 'string' },
      endpoint: { type: 'string' },
      body: { type: 'string' },
      'timeout-ms': { type: 'string', default: '60000' },
    },
    strict: true,
  });
  if (!values['base-url'] || !values.body) throw new UsageError('--base-url and --body are required');
  if (!(values.endpoint in PATHS)) throw new UsageError('--endpoint takes chat or completion');
  if (!/^\d+$/.test(values['timeout-ms'])) throw new UsageError('--timeout-ms takes an integer');
  let body;
  try {
    body = JSON.parse(values.body);
  } catch (err) {
    throw new UsageError(`--body is not JSON: ${err.message}`);
  }
  return { ...values, body };
}

// The `data` of each event in an SSE byte stream (the WHATWG EventSource rules that matter here):
// lines end in \r\n, \n or \r, even split across network reads; a blank line ends an event; `data:`
// lines (one optional space after the colon) are joined with \n; comments (`:` first, smg's
// keep-alives) and other fields are skipped; an event the stream's end cuts short is dropped.
async function* sseData(body) {
  const decoder = new TextDecoder();
  let buffer = '';
  let data = [];
  for await (const bytes of body) {
    buffer += decoder.decode(bytes, { stream: true });
    let end;
    while ((end = buffer.search(/\r\n|\n|\r/)) >= 0) {
      // A \r that ends the buffer may be the first half of \r\n: wait for the next read.
      if (buffer[end] === '\r' && end === buffer.length - 1) break;
      const line = buffer.slice(0, end);
      buffer = buffer.slice(end + (buffer.startsWith('\r\n', end) ? 2 : 1));
      if (line === '') {
        if (data.length) yield data.join('\n');
        data = [];
      } else if (line.startsWith('data:')) {
        data.push(line.slice(line.startsWith('data: ') ? 6 : 5));
      }
    }
  }
}

async function stream(args) {
  const body = { ...args.body, stream: true, stream_options: { include_usage: true } };
  const response = await fetch(args['base-url'].replace(/\/$/, '') + PATHS[args.endpoint], {
    method: 'POST',
    headers: { 'content-type': 'application/json', accept: 'text/event-stream' },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(Number(args['timeout-ms'])),
  });
  if (!response.ok) return { error: { status: response.status, body: await response.text() } };
  const parts = [];
  let finishReason = null;
  let usage = null;
  let events = 0;
  let done = false;
  for await (const data of sseData(response.body)) {
    if (done) throw new ProtocolError(`an event after [DONE]: ${data}`);
    if (data === '[DONE]') {
      done = true;
      continue;
    }
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      throw new ProtocolError(`an event that is not JSON: ${data}`);
    }
    events += 1;
    usage = event.usage ?? usage;
    for (const choice of event.choices ?? []) {
      if (choice.index !== 0) continue;
      parts.push((args.endpoint === 'chat' ? choice.delta?.content : choice.text) ?? '');
      finishReason = choice.finish_reason ?? finishReason;
    }
  }
  if (!done) throw new ProtocolError('the stream ended without data: [DONE]');
  return { text: parts.join(''), finish_reason: finishReason, usage, events };
}

await printResult('openai_stream.mjs', () => stream(parseCli(process.argv.slice(2))));
