// How the interop clients end, so that a test in another language can rely on it: ONE JSON line on
// stdout and exit 0 when the call ran (even when the server refused it: the result says so), exit 64
// on a bad invocation (UsageError, or node:util's parseArgs), exit 3 when the server broke the
// protocol (ProtocolError). Anything else is a bug in the client: it surfaces as a crash.

export class UsageError extends Error {}
export class ProtocolError extends Error {}

export async function printResult(name, produce) {
  try {
    process.stdout.write(`${JSON.stringify(await produce())}\n`);
  } catch (err) {
    if (err instanceof UsageError || String(err?.code).startsWith('ERR_PARSE_ARGS_')) {
      process.stderr.write(`${name}: ${err.message}\n`);
      process.exitCode = 64;
    } else if (err instanceof ProtocolError) {
      process.stderr.write(`${name}: protocol violation: ${err.message}\n`);
      process.exitCode = 3;
    } else {
      throw err;
    }
  }
}
