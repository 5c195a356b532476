#!/usr/bin/env node
// An independent client of moe_mesh.v1.Inference (@grpc/grpc-js + @grpc/proto-loader), driven by
// tests/test_node_client.py:
//
//   node client.mjs --address HOST:PORT --method {Generate,GenerateStream,ListModels} \
//       [--request '<json>'] [--deadline-ms N] [--encode-only] [--ca FILE] [--api-key KEY]
//
// --ca: speak TLS, checking the server's certificate against this CA; --api-key: send it as
// `authorization: Bearer KEY` metadata.
//
// Prints ONE JSON object on stdout:
//   Generate / ListModels  the response message
//   GenerateStream         {"messages": [...], "first_message_ms": t, "last_message_ms": t}
//                          (milliseconds since the call started)
//   a gRPC error           {"error": {"code": 3, "code_name": "INVALID_ARGUMENT", "details": "..."}}
//                          (plus "messages" received before it, for GenerateStream)
//   --encode-only          {"request_hex": "..."}: the request as serialized for the wire, nothing sent
// and exits 0: gRPC errors are data for the test. Exit code 1 means a usage error or a bug in this client.
//
// proto3 `optional` fields (prompt, max_tokens, temperature, top_p, top_k, min_p, seed): protobufjs turns each into a
// synthetic oneof `_name`, and proto-loader's serializer (Type.fromObject + encode) writes such a field whenever
// the request object has it with a non-null value, zero and "" included. So {"temperature": 0} is sent as
// present (the server then samples greedily) and {"prompt": ""} as a present, empty prompt; leave a key out
// (or set it to null) to send it absent.

import { readFileSync } from "node:fs";
import { performance } from "node:perf_hooks";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const REPO_ROOT = fileURLToPath(new URL("../../", import.meta.url));
const PROTO = "protos/moe_mesh/v1/inference.proto";
const SERVICE = "moe_mesh.v1.Inference";
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
                         includeDirs: [REPO_ROOT] };

const USAGE = "usage: node client.mjs --address HOST:PORT --method {Generate,GenerateStream,ListModels} " +
              "[--request '<json>'] [--deadline-ms N] [--encode-only] [--ca FILE] [--api-key KEY]";

class UsageError extends Error {}

function parseCli(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv, strict: true, allowPositionals: false,
      options: {
        address: { type: "string" },
        method: { type: "string" },
        request: { type: "string", default: "{}" },
        "deadline-ms": { type: "string" },
        "encode-only": { type: "boolean", default: false },
        ca: { type: "string" },
        "api-key": { type: "string" },
        help: { type: "boolean", short: "h", default: false },
      },
    }));
  } catch (e) {
    throw new UsageError(e.message);
  }
  if (values.help) {
    process.stdout.write(USAGE + "\n");
    process.exit(0);
  }
  if (!values.method) throw new UsageError("--method is required");
  if (!values.address && !values["encode-only"]) throw new UsageError("--address is required");
  let request;
  try {
    request = JSON.parse(values.request);
  } catch (e) {
    throw new UsageError(`--request is not valid JSON: ${e.message}`);
  }
  if (request === null || typeof request !== "object" || Array.isArray(request)) {
    throw new UsageError("--request must be a JSON object");
  }
  let deadlineMs;
  if (values["deadline-ms"] !== undefined) {
    deadlineMs = Number(values["deadline-ms"]);
    if (!Number.isFinite(deadlineMs) || deadlineMs <= 0) throw new UsageError("--deadline-ms must be a positive number");
  }
  return { address: values.address, method: values.method, request, deadlineMs, encodeOnly: values["encode-only"],
           ca: values.ca, apiKey: values["api-key"] };
}

function loadService() {
  const definition = protoLoader.loadSync(PROTO, LOADER_OPTIONS);
  const service = definition[SERVICE];
  if (!service) throw new Error(`${SERVICE} not found in ${PROTO}`);
  return service;
}

// fromObject silently drops keys that are not fields: a typo would then test the server's defaults instead.
function checkFields(method, request) {
  const known = new Set(method.requestType.type.field.map((f) => f.name));
  const unknown = Object.keys(request).filter((k) => !known.has(k));
  if (unknown.length) {
    throw new UsageError(`unknown field(s) ${unknown.join(", ")} for ${method.requestType.type.name}; ` +
                         `known: ${[...known].join(", ")}`);
  }
}

function errorResult(err) {
  if (typeof err?.code !== "number") throw err;  // not a gRPC status: a bug here
  return { error: { code: err.code, code_name: grpc.status[err.code] ?? String(err.code), details: err.details ?? "" } };
}

function unary(client, name, request, metadata, options) {
  return new Promise((resolve, reject) => {
    client[name](request, metadata, options, (err, response) => {
      if (err) {
        try { resolve(errorResult(err)); } catch (e) { reject(e); }
      } else {
        resolve(response);
      }
    });
  });
}

function serverStream(client, name, request, metadata, options) {
  return new Promise((resolve, reject) => {
    const started = performance.now();
    const messages = [];
    let first = null;
    let last = null;
    let failed = null;
    const call = client[name](request, metadata, options);
    call.on("data", (message) => {
      const t = performance.now() - started;
      if (first === null) first = t;
      last = t;
      messages.push(message);
    });
    call.on("error", (err) => { failed = err; });
    // "status" comes after "end" on success and after "error" on failure.
    call.on("status", () => {
      if (failed) {
        try { resolve({ ...errorResult(failed), messages }); } catch (e) { reject(e); }
      } else {
        resolve({ messages, first_message_ms: first, last_message_ms: last });
      }
    });
  });
}

async function main() {
  const args = parseCli(process.argv.slice(2));
  const service = loadService();
  const method = service[args.method];
  if (!method) throw new UsageError(`unknown method ${args.method}; known: ${Object.keys(service).join(", ")}`);
  checkFields(method, args.request);
  if (args.encodeOnly) {
    return { request_hex: method.requestSerialize(args.request).toString("hex") };
  }
  const Client = grpc.makeGenericClientConstructor(service, "Inference");
  const credentials = args.ca ? grpc.credentials.createSsl(readFileSync(args.ca)) : grpc.credentials.createInsecure();
  const client = new Client(args.address, credentials);
  try {
    const options = args.deadlineMs === undefined ? {} : { deadline: new Date(Date.now() + args.deadlineMs) };
    const metadata = new grpc.Metadata();
    if (args.apiKey) metadata.set("authorization", `Bearer ${args.apiKey}`);
    return method.responseStream
      ? await serverStream(client, args.method, args.request, metadata, options)
      : await unary(client, args.method, args.request, metadata, options);
  } finally {
    client.close();
  }
}

try {
  process.stdout.write(JSON.stringify(await main()) + "\n");
} catch (e) {
  process.stderr.write(e instanceof UsageError ? `client.mjs: ${e.message}\n${USAGE}\n` : `client.mjs: ${e?.stack ?? e}\n`);
  process.exitCode = 1;
}
