#!/usr/bin/env node
// Node.js interop client for cbserve: loads the .proto at run time (no generated code) and prints
// ONE JSON line on stdout so a test in another language can assert on it.
//
//   node client.mjs --target HOST:PORT --request '<GenerateRequest, proto3 JSON>' \
//        [--constraint KIND[=TEXT]] [--deadline-ms N] [--metadata k=v ...]
//   node client.mjs --target HOST:PORT --health       # grpc.health.v1.Health/Check
//   node client.mjs --target HOST:PORT --model-info   # cbserve.v1.TextGeneration/GetModelInfo
//   node client.mjs --target HOST:PORT --detokenize '<DetokenizeRequest, proto3 JSON>'
//
// --constraint sets one member of SamplingParams' `constraint` oneof (structured output), KIND named
// as the .proto spells it (json_schema, json_object, regex, ebnf, choice, structural_tag): a string
// member takes TEXT as it is (`regex=[0-9]+`), a bool member takes no TEXT (`json_object`), a message
// member takes its proto3 JSON (`choice={"choices":["yes","no"]}`). The members are read from the
// loaded .proto, so a kind added there works here unchanged. A request that sets two members of the
// oneof (protobufjs would keep one and drop the other silently) is a usage error.
//
// Every call sends the --metadata pairs (e.g. `authorization=Bearer KEY`). --tls-ca PEM connects with
// TLS, trusting that CA; --tls-cert PEM --tls-key PEM add a client certificate (mutual TLS).
//
// Generate prints {"token_ids", "text", "prompt_logprobs", "final", "chunks", "metadata"}
// (`prompt_logprobs`: every chunk's, joined); Detokenize prints the reply. A gRPC error prints
// {"error": {"code", "name", "details"}} and still exits 0 (the caller asserts on it). A broken
// stream shape (not exactly one `final`, or anything after it) or a bad invocation exits non-zero.
//
// Request field names are proto3 JSON's lowerCamelCase (`tokenIds`, `maxTokens`, `ignoreEos`):
// with keepCase: false proto-loader uses exactly those names. Unknown keys (e.g. snake_case) are
// rejected here, since protobufjs would otherwise drop them silently.

import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

import { ProtocolError, UsageError, printResult } from './cli_result.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const API_PROTO = path.resolve(HERE, '../../../proto/cbserve/v1/text_generation.proto');
const HEALTH_PROTO = path.resolve(HERE, 'health.proto');
const SERVICE = 'cbserve.v1.TextGeneration';

// longs as strings keep uint64 exact; enums as their names; defaults fill unset scalars so a
// missing field reads as its proto3 default; oneofs adds the name of the set member (e.g. `kind`).
const LOADER_OPTIONS = { keepCase: false, longs: String, enums: String, defaults: true, oneofs: true };

function parseCli(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      target: { type: 'string' },
      request: { type: 'string' },
      constraint: { type: 'string' },
      'deadline-ms': { type: 'string' },
      metadata: { type: 'string', multiple: true, default: [] },
      health: { type: 'boolean', default: false },
      'model-info': { type: 'boolean', default: false },
      detokenize: { type: 'string' },
      'tls-ca': { type: 'string' },
      'tls-cert': { type: 'string' },
      'tls-key': { type: 'string' },
    },
    strict: true,
  });
  if (!values.target) throw new UsageError('--target HOST:PORT is required');
  const modes = [
    values.health,
    values['model-info'],
    values.request !== undefined,
    values.detokenize !== undefined,
  ].filter(Boolean);
  if (modes.length !== 1) {
    throw new UsageError('give exactly one of --request, --health, --model-info, --detokenize');
  }
  if (values.constraint !== undefined && values.request === undefined) {
    throw new UsageError('--constraint goes with --request');
  }
  if (values['deadline-ms'] !== undefined && !/^\d+$/.test(values['deadline-ms'])) {
    throw new UsageError('--deadline-ms takes a non-negative integer');
  }
  if ((values['tls-cert'] === undefined) !== (values['tls-key'] === undefined)) {
    throw new UsageError('--tls-cert and --tls-key go together');
  }
  if (values['tls-cert'] !== undefined && values['tls-ca'] === undefined) {
    throw new UsageError('--tls-cert needs --tls-ca');
  }
  return values;
}

function credentials(args) {
  if (args['tls-ca'] === undefined) return grpc.credentials.createInsecure();
  const read = (file) => (file === undefined ? null : fs.readFileSync(file));
  return grpc.credentials.createSsl(read(args['tls-ca']), read(args['tls-key']), read(args['tls-cert']));
}

function loadPackage(protoPath) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(protoPath, LOADER_OPTIONS));
}

// The members of SamplingParams' `constraint` oneof, from the .proto's descriptor: snake_case name
// (as the .proto spells it) -> { key (proto3 JSON's lowerCamelCase, as the loader names it), type }.
function constraintMembers() {
  const descriptor = protoLoader.loadSync(API_PROTO, LOADER_OPTIONS)['cbserve.v1.SamplingParams'].type;
  const index = descriptor.oneofDecl.findIndex((o) => o.name === 'constraint');
  if (index < 0) throw new Error('cbserve.v1.SamplingParams has no oneof `constraint`');
  const snake = (camel) => camel.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
  return new Map(
    descriptor.field
      .filter((f) => f.oneofIndex === index)
      .map((f) => [snake(f.name), { key: f.name, type: f.type }]),
  );
}

// `spec` (KIND[=TEXT]) as the value of its oneof member; see the header.
function constraintValue(spec, members) {
  const eq = spec.indexOf('=');
  const kind = eq < 0 ? spec : spec.slice(0, eq);
  const text = eq < 0 ? null : spec.slice(eq + 1);
  const member = members.get(kind);
  if (member === undefined) {
    throw new UsageError(`--constraint kind ${JSON.stringify(kind)} is not one of ${[...members.keys()]}`);
  }
  if (member.type === 'TYPE_BOOL') {
    if (text !== null && text !== 'true') throw new UsageError(`--constraint ${kind} takes no text`);
    return [member.key, true];
  }
  if (text === null) throw new UsageError(`--constraint ${kind} needs =TEXT`);
  if (member.type !== 'TYPE_MESSAGE') return [member.key, text];
  try {
    return [member.key, JSON.parse(text)];
  } catch (err) {
    throw new UsageError(`--constraint ${kind} takes its message as JSON: ${err.message}`);
  }
}

// The request with --constraint set, once: at most one member of the oneof, whoever set it.
function withConstraint(request, spec) {
  const given = request.sampling;
  if (given !== undefined && (given === null || typeof given !== 'object' || Array.isArray(given))) {
    throw new UsageError('sampling must be a JSON object');
  }
  const members = constraintMembers();
  const keys = [...members.values()].map((m) => m.key);
  const sampling = { ...(given ?? {}) };
  const set = () => keys.filter((k) => k in sampling);
  if (spec !== undefined) {
    if (set().length > 0) throw new UsageError(`--constraint and --request both set sampling.${set()[0]}`);
    const [key, value] = constraintValue(spec, members);
    sampling[key] = value;
  }
  if (set().length > 1) {
    throw new UsageError(`sampling sets ${set().join(' and ')}; the constraint oneof takes one`);
  }
  return given === undefined && spec === undefined ? request : { ...request, sampling };
}

function callOptions(args) {
  const ms = args['deadline-ms'];
  return ms === undefined ? {} : { deadline: new Date(Date.now() + Number(ms)) };
}

function buildMetadata(pairs) {
  const md = new grpc.Metadata();
  for (const pair of pairs) {
    const eq = pair.indexOf('=');
    if (eq <= 0) throw new UsageError(`--metadata takes key=value, got ${JSON.stringify(pair)}`);
    md.add(pair.slice(0, eq).toLowerCase(), pair.slice(eq + 1));
  }
  return md;
}

function metadataToJson(md) {
  const out = {};
  for (const [key, value] of Object.entries(md ? md.getMap() : {})) {
    out[key] = Buffer.isBuffer(value) ? value.toString('base64') : value; // `-bin` keys are bytes
  }
  return out;
}

// Drops protobufjs' synthetic-oneof markers of proto3 `optional` fields (`_temperature: "temperature"`).
function clean(value) {
  if (Array.isArray(value)) return value.map(clean);
  if (value === null || typeof value !== 'object') return value;
  return Object.fromEntries(
    Object.entries(value).filter(([k]) => !k.startsWith('_')).map(([k, v]) => [k, clean(v)]),
  );
}

// Every key of `given` must survive an encode/decode round trip (which, with defaults: true,
// lists every known field); a key that does not is not a field of the message.
function checkKnownFields(given, decoded, where, flag) {
  if (Array.isArray(given)) {
    given.forEach((item, i) => checkKnownFields(item, decoded?.[i], `${where}[${i}]`, flag));
    return;
  }
  if (given === null || typeof given !== 'object') return;
  for (const [key, value] of Object.entries(given)) {
    const at = where ? `${where}.${key}` : key;
    if (decoded === null || typeof decoded !== 'object' || !(key in decoded)) {
      throw new UsageError(`unknown field ${at} in ${flag} (field names are lowerCamelCase)`);
    }
    checkKnownFields(value, decoded[key], at, flag);
  }
}

// `text`, the value of the command-line flag `flag`, as a request message of `method`, passed through
// `amend` (a function of the parsed object) before its fields are checked.
function parseRequest(text, method, flag, amend = (request) => request) {
  let request;
  try {
    request = JSON.parse(text);
  } catch (err) {
    throw new UsageError(`${flag} is not JSON: ${err.message}`);
  }
  if (request === null || typeof request !== 'object' || Array.isArray(request)) {
    throw new UsageError(`${flag} must be a JSON object`);
  }
  request = amend(request);
  checkKnownFields(request, method.requestDeserialize(method.requestSerialize(request)), '', flag);
  return request;
}

function grpcError(err) {
  if (typeof err?.code !== 'number') throw err; // not a status: a bug here, let it surface
  const name = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code) ?? 'UNKNOWN';
  return { error: { code: err.code, name, details: err.details ?? err.message } };
}

function unary(client, method, request, args) {
  return new Promise((resolve, reject) => {
    client[method](request, buildMetadata(args.metadata), callOptions(args), (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

// The stream must be: chunks, then exactly one `final`, then nothing. On an error status the
// `final` may be missing, but anything that did arrive must still respect that order.
function checkShape(messages, completed) {
  messages.forEach((m, i) => {
    if (m.kind !== 'chunk' && m.kind !== 'final') {
      throw new ProtocolError(`message ${i} has neither chunk nor final set`);
    }
  });
  const finals = messages.flatMap((m, i) => (m.kind === 'final' ? [i] : []));
  if (finals.length > 1) throw new ProtocolError(`${finals.length} final messages (at ${finals})`);
  if (finals.length === 1 && finals[0] !== messages.length - 1) {
    throw new ProtocolError(`final is message ${finals[0]} of ${messages.length}; messages follow it`);
  }
  if (completed && finals.length === 0) throw new ProtocolError('stream ended OK without a final message');
}

async function generate(args) {
  const { TextGeneration } = loadPackage(API_PROTO).cbserve.v1;
  const request = parseRequest(args.request, TextGeneration.service.Generate, '--request', (r) =>
    withConstraint(r, args.constraint),
  );
  const client = new TextGeneration(args.target, credentials(args));
  const messages = [];
  let initialMetadata = null;
  try {
    await new Promise((resolve, reject) => {
      const call = client.Generate(request, buildMetadata(args.metadata), callOptions(args));
      call.on('metadata', (md) => {
        initialMetadata = md;
      });
      call.on('data', (m) => messages.push(m));
      call.on('end', resolve); // OK status: grpc-js emits either 'end' or 'error', not both
      call.on('error', reject);
    });
  } catch (err) {
    checkShape(messages, false);
    return grpcError(err);
  } finally {
    client.close();
  }
  checkShape(messages, true);
  const chunks = messages.slice(0, -1).map((m) => m.chunk);
  return {
    token_ids: chunks.flatMap((c) => c.tokenIds),
    text: chunks.map((c) => c.text).join(''),
    prompt_logprobs: clean(chunks.flatMap((c) => c.promptLogprobs)),
    final: clean(messages.at(-1).final),
    chunks: chunks.length,
    metadata: metadataToJson(initialMetadata),
  };
}

async function health(args) {
  const { Health } = loadPackage(HEALTH_PROTO).grpc.health.v1;
  const client = new Health(args.target, credentials(args));
  try {
    const reply = await unary(client, 'Check', { service: SERVICE }, args);
    return { status: reply.status };
  } catch (err) {
    return grpcError(err);
  } finally {
    client.close();
  }
}

async function modelInfo(args) {
  const { TextGeneration } = loadPackage(API_PROTO).cbserve.v1;
  const client = new TextGeneration(args.target, credentials(args));
  try {
    return clean(await unary(client, 'GetModelInfo', {}, args));
  } catch (err) {
    return grpcError(err);
  } finally {
    client.close();
  }
}

async function detokenize(args) {
  const { TextGeneration } = loadPackage(API_PROTO).cbserve.v1;
  const request = parseRequest(args.detokenize, TextGeneration.service.Detokenize, '--detokenize');
  const client = new TextGeneration(args.target, credentials(args));
  try {
    return await unary(client, 'Detokenize', request, args);
  } catch (err) {
    return grpcError(err);
  } finally {
    client.close();
  }
}

function command(args) {
  if (args.health) return health;
  if (args['model-info']) return modelInfo;
  if (args.detokenize !== undefined) return detokenize;
  return generate;
}

await printResult('client.mjs', () => {
  const args = parseCli(process.argv.slice(2));
  return command(args)(args);
});
