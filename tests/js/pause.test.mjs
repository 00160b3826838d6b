// Filesystem-only pauses through the official e2b JavaScript SDK:
// pause({ keepMemory: false }), the lifecycle's onTimeout { action: 'pause',
// keepMemory: false } and connect(..., { onResume: 'reboot' }) on a memory pause.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

async function sleepers(sbx) {
  const r = await sbx.commands.run("pgrep -f '^sleep 4242' || true")
  return r.stdout.trim()
}

test('pause without memory reboots with the files kept', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 300_000 })
  try {
    await sbx.files.write('/home/user/js-kept.txt', 'kept by a filesystem pause')
    await sbx.commands.run('sleep 4242', { background: true })
    assert.notEqual(await sleepers(sbx), '')
    const pausedAt = Date.now()
    assert.equal(await sbx.pause({ keepMemory: false }), true)
    assert.equal((await sbx.getInfo()).state, 'paused')

    await Sandbox.connect(sbx.sandboxId)
    assert.equal(await sbx.files.read('/home/user/js-kept.txt'), 'kept by a filesystem pause')
    assert.equal(await sleepers(sbx), '')
    const uptime = Number((await sbx.commands.run('cat /proc/uptime')).stdout.split(' ')[0])
    assert.ok(uptime > 0)
    assert.ok(uptime * 1000 < Date.now() - pausedAt, `uptime ${uptime}s: not rebooted`)
  } finally {
    await sbx.kill()
  }
})

test('a timeout pauses without memory when the lifecycle says so', async () => {
  const sbx = await Sandbox.create('base', {
    timeoutMs: 4_000, lifecycle: { onTimeout: { action: 'pause', keepMemory: false } },
  })
  try {
    await sbx.files.write('/home/user/note.txt', 'before the timeout')
    await sbx.commands.run('sleep 4242', { background: true })
    const deadline = Date.now() + 60_000
    while ((await sbx.getInfo()).state !== 'paused') {
      assert.ok(Date.now() < deadline, 'not paused at its timeout')
      await new Promise((r) => setTimeout(r, 500))
    }
    await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
    assert.equal(await sbx.files.read('/home/user/note.txt'), 'before the timeout')
    assert.equal(await sleepers(sbx), '')
  } finally {
    await sbx.kill()
  }
})

test('a reboot of a memory pause is a clear error, and the sandbox stays paused', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000 })
  try {
    await sbx.pause()
    await assert.rejects(Sandbox.connect(sbx.sandboxId, { onResume: 'reboot' }),
      /paused with its memory/)
    assert.equal((await sbx.getInfo()).state, 'paused')
  } finally {
    await sbx.kill()
  }
})
