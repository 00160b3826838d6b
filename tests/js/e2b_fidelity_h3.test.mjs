// E2B fidelity (issue 14, items 2-4) through the JavaScript SDK, unchanged (run by
// tests/test_e2b_js.py): list order and paging, snapshots as templates, template tags.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { Sandbox, Template } from 'e2b'

async function pages(paginator, between) {
  const out = []
  while (paginator.hasNext) {
    out.push((await paginator.nextItems()).map((s) => s.sandboxId))
    if (between && out.length === 1) await between()
  }
  return out
}

test('Sandbox.list: newest first, pages stable by state, a create between pages', async () => {
  const tag = randomUUID()
  const made = []
  try {
    for (let i = 0; i < 3; i++) {
      made.push(await Sandbox.create('base', { timeoutMs: 120_000, metadata: { tag } }))
    }
    await made[1].pause()
    const newest = made.map((s) => s.sandboxId).reverse()
    let late
    const both = await pages(Sandbox.list({ query: { metadata: { tag } }, limit: 2 }), async () => {
      late = await Sandbox.create('base', { timeoutMs: 120_000, metadata: { tag } })
      made.push(late)
    })
    assert.deepEqual(both, [newest.slice(0, 2), newest.slice(2)])
    const running = await pages(Sandbox.list({ query: { metadata: { tag }, state: ['running'] },
                                               limit: 1 }))
    assert.deepEqual(running, [[late.sandboxId], [newest[0]], [newest[2]]])
    const paused = await pages(Sandbox.list({ query: { metadata: { tag }, state: ['paused'] },
                                              limit: 1 }))
    assert.deepEqual(paused, [[newest[1]]])
    const asc = await Sandbox.list({ query: { metadata: { tag } }, order: 'asc' }).nextItems()
    assert.deepEqual(asc.map((s) => s.sandboxId), [...newest.reverse(), late.sandboxId])
  } finally {
    for (const s of made) await s.kill()
  }
})

test('snapshots: createSnapshot, listSnapshots, create from it, deleteSnapshot', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 300_000 })
  let child
  try {
    await sbx.files.write('/home/user/js-state.txt', 'js snapshot')
    const name = `js-keep-${sbx.sandboxId.slice(0, 8)}`
    const snap = await sbx.createSnapshot({ name })
    assert.deepEqual(snap.names, [name])
    const pager = Sandbox.listSnapshots({ limit: 1 })
    const listed = []
    while (pager.hasNext) listed.push(...(await pager.nextItems()).map((s) => s.snapshotId))
    assert.ok(listed.includes(snap.snapshotId))
    assert.equal(listed.length, new Set(listed).size)
    const named = await Sandbox.listSnapshots({ name: `${name}:default` }).nextItems()
    assert.deepEqual(named.map((s) => s.snapshotId), [snap.snapshotId])
    assert.deepEqual((await sbx.listSnapshots().nextItems()).map((s) => s.snapshotId),
      [snap.snapshotId])
    child = await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 })
    assert.equal(await child.files.read('/home/user/js-state.txt'), 'js snapshot')

    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    const left = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
    assert.deepEqual(left, [])
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
    assert.equal(await Sandbox.deleteSnapshot(name), false)
    await assert.rejects(Sandbox.create(name, { timeoutMs: 60_000 }), /not found/)
    // the sandbox restored from it runs on
    assert.equal((await child.commands.run('cat /home/user/js-state.txt')).stdout, 'js snapshot')
  } finally {
    await child?.kill()
    await sbx.kill()
  }
})

test('template tags: assignTags, getTags, create by name:tag, move, removeTags', async () => {
  const name = `xbt-jstag-${randomUUID().slice(0, 6)}`
  const version = (text) =>
    Template().fromTemplate('base').runCmd(`echo ${text} > /home/user/v.txt`)
  const read = async (ref) => {
    const sbx = await Sandbox.create(ref, { timeoutMs: 120_000 })
    try {
      return (await sbx.commands.run('cat /home/user/v.txt')).stdout.trim()
    } finally {
      await sbx.kill()
    }
  }
  const tags = async () =>
    Object.fromEntries((await Template.getTags(name)).map((t) => [t.tag, t.buildId]))
  const one = await Template.build(version('one'), name)
  try {
    const assigned = await Template.assignTags(`${name}:default`, 'js1')
    assert.deepEqual(assigned, { buildId: one.buildId, tags: ['js1'] })
    const two = await Template.build(version('two'), name)
    assert.deepEqual(await tags(), { default: two.buildId, js1: one.buildId })
    assert.ok((await Template.getTags(name)).every((t) => !isNaN(t.createdAt.getTime())))
    assert.equal(await read(`${name}:js1`), 'one')
    assert.equal(await read(name), 'two')
    // move the tag to the current build
    assert.equal((await Template.assignTags(name, ['js1'])).buildId, two.buildId)
    assert.equal(await read(`${name}:js1`), 'two')
    await Template.removeTags(name, 'js1')
    assert.deepEqual(await tags(), { default: two.buildId })
    await assert.rejects(Sandbox.create(`${name}:js1`, { timeoutMs: 60_000 }), /no tag 'js1'/)
    await assert.rejects(Template.assignTags(name, 'Not a tag!'), /400/)
    await assert.rejects(Template.removeTags(name, 'default'), /default/)
  } finally {
    const res = await fetch(`${process.env.E2B_API_URL}/templates/${name}`, {
      method: 'DELETE', headers: { 'X-API-Key': process.env.E2B_API_KEY } })
    assert.equal(res.status, 204)
  }
})
