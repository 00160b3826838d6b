// The code-interpreter template's JavaScript and TypeScript kernel: tslab (npm), started
// here instead of by its own `tslab kernel`, with three changes so that a run's outputs are
// what E2B's JavaScript kernel gives the e2b-code-interpreter SDKs:
//   - the value of the code's last expression is the run's result (an execute_result,
//     util.inspect's text: the SDK's `execution.text`), where tslab console.logs it;
//   - an exception or a compile error is the run's error (an `error` message with its name,
//     message and stack), where tslab writes it to stderr; and the run is counted
//     (execute_input), as Jupyter kernels do;
//   - with an `ipc` connection file its sockets are Unix sockets ("ipc://<ip>-<port>",
//     Jupyter's naming; tslab binds "<transport>://<ip>:<port>"), as ipykernel's are. This
//     runsc saves an epoll's ready list without its lock, and a notification landing during
//     the save can leave a deleted interest in it: restored, the server's libzmq got an event
//     for a freed poller entry and died (SIGSEGV in a ZMQbg/IO thread, 1 image in ~10 under
//     load). While the tasks are stopped for a save nothing notifies a Unix socket, but
//     netstack's own goroutines and timers (ACKs) still notify loopback TCP endpoints.
// Usage: node aenv_jslab.js <connection file> [--js]
"use strict";
const util = require("util");
const { createConverter } = require("tslab/dist/converter");
const { createExecutor } = require("tslab/dist/executor");
const jupyter = require("tslab/dist/jupyter");

const [configPath, ...flags] = process.argv.slice(2);
const isJS = flags.includes("--js");

// The execution in progress: how to send IOPub messages answering it, and its compile errors.
let current = null;

jupyter.ZmqServer.prototype.bindSocket = async function (sock, port) {
  const c = this.connInfo;
  await sock.bind(c.transport === "ipc" ? `ipc://${c.ip}-${port}` : `${c.transport}://${c.ip}:${port}`);
};

jupyter.ZmqServer.prototype.handleExecute = async function (sock, msg) {
  const publish = (type, content) => {
    const m = msg.createReply();
    m.header.msg_type = type;
    m.content = content;
    m.signAndSend(this.connInfo.key, this.iopub);
  };
  const writeStream = (name, text) => publish("stream", { name, text });
  const writeDisplayData = (data, update) => publish(update ? "update_display_data" : "display_data", data);
  writeDisplayData.publish = publish; // read back in the queued task: it is this run's
  const reply = msg.createReply();
  reply.header.msg_type = "execute_reply";
  reply.content = await this.handler.handleExecute(msg.content, writeStream, writeDisplayData);
  reply.signAndSend(this.connInfo.key, sock);
};

// Around tslab's body of an execution (handleExecuteImpl, which counts it): the run is
// announced and its compile errors reported. Executions run one at a time (tslab's queue),
// so `current` is this run's.
const executeImpl = jupyter.JupyterHandlerImpl.prototype.handleExecuteImpl;
jupyter.JupyterHandlerImpl.prototype.handleExecuteImpl = async function (req, writeStream, writeDisplayData) {
  current = { publish: writeDisplayData.publish, count: this.execCount + 1, diagnostics: [] };
  current.publish("execute_input", { code: req.code, execution_count: current.count });
  try {
    return await executeImpl.call(this, req, writeStream, writeDisplayData);
  } catch (e) {
    if (current.diagnostics.length) {
      const text = current.diagnostics.join("\n");
      error(isJS ? "CompileError" : "TSError", text, [text]);
    }
    throw e;
  }
};

function error(ename, evalue, traceback) {
  current.publish("error", { ename, evalue, traceback });
}

// The executor reports the last expression's value through `log`, and errors (an exception
// caught, or a compile diagnostic: several arguments, printf style) through `error`.
const reporter = {
  log: (value) => {
    current.publish("execute_result", {
      execution_count: current.count,
      data: { "text/plain": util.inspect(value) },
      metadata: {},
    });
  },
  error: (first, ...rest) => {
    if (rest.length) {
      current.diagnostics.push(util.format(first, ...rest));
    } else if (first instanceof Error) {
      error(first.name || "Error", first.message, [first.stack || String(first)]);
    } else {
      error("Error", util.inspect(first), [util.inspect(first)]);
    }
  },
};

const node = createConverter({ isJS, isBrowser: false });
let browser = null;
const convs = {
  node,
  get browser() {
    return (browser ??= createConverter({ isJS, isBrowser: true }));
  },
  close() {
    node.close();
    browser?.close();
  },
};
const executor = createExecutor(process.cwd(), convs, reporter);
const handler = new jupyter.JupyterHandlerImpl(executor, isJS);
// After a failed run tslab cancels every run that comes in the next 200 ms (to drop those
// queued behind it); the server sends its next one (an env var reset) as soon as the
// failed one ends. Only the runs already queued are dropped now.
handler.execQueue.reset = function () {
  this.prev = Promise.resolve();
};
const server = new jupyter.ZmqServer(handler, configPath);
process.on("SIGINT", () => executor.interrupt());
process.on("uncaughtException", (err) => console.error("UncaughtException:", err));
process.on("unhandledRejection", (reason) => console.error("UnhandledPromiseRejection:", reason));
server.init();
