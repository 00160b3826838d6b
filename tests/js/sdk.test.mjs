// The official e2b JavaScript SDK, unchanged, against an agentenv node.
// Run by tests/test_e2b_js.py with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY
// pointing at the session's node (and AENV_NODE_PORT, for Host routing).
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { randomUUID } from 'node:crypto'
import {
  AuthenticationError,
  CommandExitError,
  NotFoundError,
  Sandbox,
  TimeoutError,
} from 'e2b'

const NODE_PORT = Number(process.env.AENV_NODE_PORT)

// GET through the node, naming the sandbox's host (`<port>-<id>.<domain>`, the domain
// being localhost:<node port>) while dialing 127.0.0.1: Node's resolver may not
// resolve *.localhost.
function getViaHost(host, path, headers = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: '127.0.0.1', port: NODE_PORT, path, headers: { ...headers, host } },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (c) => (body += c))
        res.on('end', () => resolve({ status: res.statusCode, body }))
      },
    )
    req.on('error', reject)
    req.end()
  })
}

async function until(check, timeoutMs = 15_000) {
  const end = Date.now() + timeoutMs
  for (;;) {
    if (await check()) return
    if (Date.now() > end) throw new Error('condition not met in time')
    await new Promise((r) => setTimeout(r, 50))
  }
}

describe('e2b JS SDK against agentenv', () => {
  const tag = randomUUID()
  let sbx

  before(async () => {
    sbx = await Sandbox.create('base', {
      timeoutMs: 300_000,
      metadata: { suite: 'js', tag },
      envs: { GREETING: 'hello from js' },
    })
  })

  after(async () => {
    await sbx?.kill()
  })

  test('create: info, metadata, envs, secure token', async () => {
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.templateId, 'base')
    assert.deepEqual(info.metadata, { suite: 'js', tag })
    assert.equal(info.state, 'running')
    assert.equal(info.cpuCount, 2)
    assert.ok(info.endAt > info.startedAt)
    const r = await sbx.commands.run('echo $GREETING')
    assert.equal(r.stdout, 'hello from js\n')
    assert.match(await sbx.downloadUrl('/etc/hostname'), /signature=/)
  })

  test('isRunning, setTimeout, connect', async () => {
    assert.equal(await sbx.isRunning(), true)
    await sbx.setTimeout(60_000)
    const soon = (await sbx.getInfo()).endAt
    await sbx.setTimeout(400_000)
    assert.ok((await sbx.getInfo()).endAt - soon > 300_000)
    const again = await Sandbox.connect(sbx.sandboxId)
    await again.files.write('/home/user/from-connect.txt', 'same box')
    assert.equal(await sbx.files.read('/home/user/from-connect.txt'), 'same box')
  })

  test('commands: foreground, streamed output, cwd, user, envs, exit error', async () => {
    const out = []
    const err = []
    const r = await sbx.commands.run('echo one; echo two >&2; pwd; id -un; echo $X', {
      cwd: '/tmp',
      envs: { X: 'x-value' },
      onStdout: (d) => out.push(d),
      onStderr: (d) => err.push(d),
    })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'one\n/tmp\nuser\nx-value\n')
    assert.equal(out.join(''), r.stdout)
    assert.equal(err.join(''), 'two\n')
    assert.equal((await sbx.commands.run('id -un', { user: 'root' })).stdout, 'root\n')
    await assert.rejects(sbx.commands.run('echo bad >&2; exit 4'), (e) => {
      assert.ok(e instanceof CommandExitError)
      assert.equal(e.exitCode, 4)
      assert.equal(e.stderr, 'bad\n')
      return true
    })
  })

  test('commands: background, list, stdin, kill, timeout', async () => {
    const h = await sbx.commands.run('read line; echo got:$line', { background: true, stdin: true })
    assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
    await sbx.commands.sendStdin(h.pid, 'typed\n')
    const done = await h.wait()
    assert.equal(done.stdout, 'got:typed\n')

    const sleeper = await sbx.commands.run('sleep 600', { background: true })
    assert.equal(await sbx.commands.kill(sleeper.pid), true)
    await assert.rejects(sleeper.wait(), CommandExitError)

    await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1000 }), TimeoutError)
  })

  test('pty: input, resize, output, kill', async () => {
    const chunks = []
    const decoder = new TextDecoder()
    const pty = await sbx.pty.create({
      cols: 80,
      rows: 24,
      onData: (d) => chunks.push(decoder.decode(d, { stream: true })),
    })
    const output = () => chunks.join('')
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('echo pty-$((6*7))\n'))
    await until(() => output().includes('pty-42'))
    await sbx.pty.resize(pty.pid, { cols: 100, rows: 30 })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size\n'))
    await until(() => output().includes('30 100'))
    assert.equal(await sbx.pty.kill(pty.pid), true)
  })

  test('files: write, read, list, exists, info, rename, remove, urls', async () => {
    await sbx.files.write('/home/user/js/a.txt', 'alpha')
    await sbx.files.write([
      { path: '/home/user/js/b.txt', data: 'beta' },
      { path: '/home/user/js/sub/c.bin', data: new Uint8Array([0, 1, 2]).buffer },
    ])
    assert.equal(await sbx.files.read('/home/user/js/a.txt'), 'alpha')
    const bytes = await sbx.files.read('/home/user/js/sub/c.bin', { format: 'bytes' })
    assert.deepEqual([...bytes], [0, 1, 2])
    const names = (await sbx.files.list('/home/user/js', { depth: 2 })).map((e) => e.path).sort()
    assert.deepEqual(names, [
      '/home/user/js/a.txt', '/home/user/js/b.txt', '/home/user/js/sub', '/home/user/js/sub/c.bin',
    ])
    assert.equal(await sbx.files.exists('/home/user/js/a.txt'), true)
    assert.equal((await sbx.files.getInfo('/home/user/js/a.txt')).size, 5)
    await sbx.files.rename('/home/user/js/a.txt', '/home/user/js/renamed.txt')
    await sbx.files.remove('/home/user/js/b.txt')
    assert.equal(await sbx.files.exists('/home/user/js/b.txt'), false)
    assert.equal(await sbx.files.makeDir('/home/user/js/newdir'), true)

    const res = await fetch(await sbx.downloadUrl('/home/user/js/renamed.txt'))
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'alpha')
    const form = new FormData()
    form.append('file', new Blob(['via upload url']), 'up.txt')
    const up = await fetch(await sbx.uploadUrl('/home/user/js/up.txt'), { method: 'POST', body: form })
    assert.equal(up.status, 200)
    assert.equal(await sbx.files.read('/home/user/js/up.txt'), 'via upload url')
  })

  test('files: read of procfs files (size 0) returns their content; python is python3', async () => {
    const uptime = await sbx.files.read('/proc/uptime')
    assert.equal(uptime.trim().split(/\s+/).length, 2, uptime)
    const bootId = await sbx.files.read('/proc/sys/kernel/random/boot_id')
    assert.match(bootId, /^[0-9a-f-]{36}\n$/)
    assert.equal((await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout, bootId)
    const py = await sbx.commands.run("python -c 'import sys; print(sys.version_info[0])'")
    assert.equal(py.stdout, '3\n')
  })

  test('sudo: the default user becomes root, passwordless', async () => {
    assert.equal((await sbx.commands.run('sudo whoami')).stdout, 'root\n')
    assert.equal((await sbx.commands.run('sudo -n true')).exitCode, 0)
  })

  test('files: watchDir sees create, write, remove', async () => {
    await sbx.files.makeDir('/home/user/jswatch')
    const events = []
    const handle = await sbx.files.watchDir('/home/user/jswatch', (e) => events.push(e))
    await sbx.files.write('/home/user/jswatch/f.txt', 'x')
    await sbx.files.remove('/home/user/jswatch/f.txt')
    await until(() => events.some((e) => e.type === 'remove'))
    const types = new Set(events.filter((e) => e.name === 'f.txt').map((e) => e.type))
    for (const t of ['create', 'write', 'remove']) assert.ok(types.has(t), `no ${t}: ${[...types]}`)
    await handle.stop()
  })

  test('list with metadata and state, paged', async () => {
    const extra = await Sandbox.create('base', { timeoutMs: 120_000, metadata: { tag } })
    try {
      const pager = Sandbox.list({ query: { metadata: { tag }, state: ['running'] }, limit: 1 })
      const seen = []
      while (pager.hasNext) seen.push(...(await pager.nextItems()))
      assert.deepEqual(seen.map((s) => s.sandboxId).sort(), [sbx.sandboxId, extra.sandboxId].sort())
      const paused = Sandbox.list({ query: { metadata: { tag }, state: ['paused'] } })
      assert.deepEqual(await paused.nextItems(), [])
    } finally {
      await extra.kill()
    }
  })

  test('metrics', async () => {
    const metrics = await sbx.getMetrics()
    assert.ok(metrics.length >= 1)
    assert.ok(metrics[0].memTotal > 0 && metrics[0].cpuCount === 2)
  })

  test('ports: getHost reaches a server inside; closed port is a 502', async () => {
    await sbx.files.write('/home/user/www/index.html', 'js-served\n')
    await sbx.commands.run('cd /home/user/www && python3 -m http.server 8081', { background: true })
    const host = sbx.getHost(8081)
    assert.equal(host, `8081-${sbx.sandboxId}.localhost:${NODE_PORT}`)
    let res
    await until(async () => {
      res = await getViaHost(host, '/index.html')
      return res.status === 200
    })
    assert.equal(res.body, 'js-served\n')
    const closed = await getViaHost(sbx.getHost(9998), '/')
    assert.equal(closed.status, 502)
    assert.match(JSON.parse(closed.body).message, /port is not open/)
  })

  test('errors: unknown sandbox, wrong key', async () => {
    await assert.rejects(Sandbox.connect('nosuchsandbox0000000'), NotFoundError)
    await assert.rejects(Sandbox.getInfo('nosuchsandbox0000000'), NotFoundError)
    assert.equal(await Sandbox.kill('nosuchsandbox0000000'), false)
    await assert.rejects(Sandbox.create('base', { apiKey: 'aenv_wrong' }), AuthenticationError)
    await assert.rejects(Sandbox.list({ apiKey: 'aenv_wrong' }).nextItems(), AuthenticationError)
  })

  test('kill ends the sandbox', async () => {
    const s = await Sandbox.create('base', { timeoutMs: 60_000 })
    assert.equal(await s.isRunning(), true)
    await s.kill()
    assert.equal(await s.isRunning(), false)
    await assert.rejects(s.getInfo(), NotFoundError)
  })
})
