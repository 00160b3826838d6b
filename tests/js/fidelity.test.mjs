// E2B fidelity (issue 14) through the official JS SDK: file metadata on overwrite,
// command deadlines, a sandbox killed while a command streams.
// Run by tests/test_e2b_js.py against the session's node.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, TimeoutError } from 'e2b'

describe('E2B fidelity: metadata, deadlines, kills', () => {
  let sbx

  before(async () => {
    sbx = await Sandbox.create('base', { timeoutMs: 120_000 })
  })

  after(async () => {
    await sbx?.kill()
  })

  test('item 8: an overwrite replaces the file metadata', async () => {
    const path = '/home/user/jsmeta/m.txt'
    let info = await sbx.files.write(path, 'one', { metadata: { Owner: 'alice', stage: 'raw' } })
    assert.deepEqual(info.metadata, { owner: 'alice', stage: 'raw' })
    assert.deepEqual((await sbx.files.getInfo(path)).metadata, { owner: 'alice', stage: 'raw' })
    info = await sbx.files.write(path, 'two', { metadata: { stage: 'clean' } })
    assert.deepEqual((await sbx.files.getInfo(path)).metadata, { stage: 'clean' })
    info = await sbx.files.write(path, 'three')
    assert.equal(info.metadata, undefined)
    assert.equal((await sbx.files.getInfo(path)).metadata, undefined)
    assert.equal(await sbx.files.read(path), 'three')
  })

  test('item 9: a command or an attached stream past its timeoutMs is a TimeoutError', async () => {
    const t0 = Date.now()
    await assert.rejects(sbx.commands.run('sleep 10', { timeoutMs: 1500 }), TimeoutError)
    assert.ok(Date.now() - t0 < 8000)
    const bg = await sbx.commands.run('sleep 30', { background: true })
    // The deadline covers the attach too: on a loaded host it can fire before connect()
    // returns (it did at load 30), and that is the same TimeoutError.
    const attached = sbx.commands.connect(bg.pid, { timeoutMs: 1000 }).then((h) => h.wait())
    await assert.rejects(attached, TimeoutError)
    // the deadline bounded the attached stream only: the command still runs
    assert.ok((await sbx.commands.list()).some((p) => p.pid === bg.pid))
    assert.equal(await sbx.commands.kill(bg.pid), true)
  })

  test('item 10: a sandbox killed mid-command ends the stream with an error', async () => {
    const victim = await Sandbox.create('base', { timeoutMs: 60_000 })
    const out = []
    let killed
    const t0 = Date.now()
    await assert.rejects(
      victim.commands.run('echo started; sleep 30', {
        timeoutMs: 60_000,
        onStdout: (d) => {
          out.push(d)
          killed ??= Sandbox.kill(victim.sandboxId)
        },
      }),
      (e) => {
        assert.ok(e instanceof TimeoutError, `${e?.constructor?.name}: ${e?.message}`)
        assert.match(e.message, /ended before the stream completed/)
        assert.doesNotMatch(e.message, /chunk|terminated/i)
        return true
      },
    )
    assert.equal(await killed, true)
    assert.deepEqual(out, ['started\n'])
    assert.ok(Date.now() - t0 < 20_000)
    // the node still serves
    assert.equal((await sbx.commands.run('echo alive')).stdout, 'alive\n')
  })
})
