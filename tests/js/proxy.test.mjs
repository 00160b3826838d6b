// The sandbox proxy as the JS SDK's options shape it: lifecycle.autoResume (traffic
// resumes a paused sandbox) and network.maskRequestHost (the Host its ports see).
// Run by tests/test_e2b_js.py (E2B_* and AENV_NODE_PORT point at the session's node).
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { Sandbox } from 'e2b'

const NODE_PORT = Number(process.env.AENV_NODE_PORT)
const PORT = 8083

// Answers every GET with the Host and X-Forwarded-Host it received.
const HOST_ECHO = `
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"host": self.headers.get("Host"),
                           "forwarded": self.headers.get("X-Forwarded-Host")}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`

// GET through the node by the sandbox's host (getHost: <port>-<id>.localhost:<node
// port>), dialing 127.0.0.1: Node's resolver may not resolve *.localhost.
function getViaHost(host, path) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port: NODE_PORT, path, headers: { host } },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (c) => (body += c))
        res.on('end', () => resolve({ status: res.statusCode, body }))
      })
    req.on('error', reject)
    req.end()
  })
}

describe('proxy options of the JS SDK', () => {
  let sbx

  before(async () => {
    sbx = await Sandbox.create('base', {
      timeoutMs: 300_000,
      lifecycle: { onTimeout: 'pause', autoResume: true },
      network: { maskRequestHost: '${PORT}-js.example.com' },
    })
    await sbx.files.write('/home/user/host_echo.py', HOST_ECHO)
    await sbx.commands.run(`python3 /home/user/host_echo.py ${PORT}`, { background: true })
    await sbx.commands.run(`for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/${PORT}) ` +
                           '2>/dev/null && exit 0; sleep 0.1; done; exit 1')
  })

  after(async () => {
    await sbx?.kill()
  })

  test('create options are kept: lifecycle and maskRequestHost', async () => {
    const info = await sbx.getInfo()
    assert.deepEqual(info.lifecycle, { onTimeout: 'pause', autoResume: true })
    assert.equal(info.network.maskRequestHost, '${PORT}-js.example.com')
  })

  test('a port sees the masked Host; traffic resumes the paused sandbox', async () => {
    const host = sbx.getHost(PORT)
    assert.equal(host, `${PORT}-${sbx.sandboxId}.localhost:${NODE_PORT}`)
    let res = await getViaHost(host, '/')
    assert.equal(res.status, 200)
    assert.deepEqual(JSON.parse(res.body), { host: `${PORT}-js.example.com`, forwarded: host })

    await sbx.pause()
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    res = await getViaHost(host, '/again')
    assert.equal(res.status, 200, res.body)
    assert.deepEqual(JSON.parse(res.body), { host: `${PORT}-js.example.com`, forwarded: host })
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'running')
    assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n')
  })
})
