// E2B fidelity (issue 14) through the JavaScript SDK, unchanged (run by
// tests/test_e2b_js.py): list order and paging, snapshots as templates, template tags.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { Sandbox } from 'e2b'

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
