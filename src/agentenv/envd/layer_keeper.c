/* layer-keeper: the one process in a sandbox that may mount, and only for envd.
 *
 * envd gives up CAP_SYS_ADMIN at start-up (bootid.py) so that no command, root's
 * included, can mount. Before it does, it starts this helper with one end of a
 * SOCK_SEQPACKET socket pair as descriptor 3: the helper keeps the capability and
 * performs mount(2) and umount2(2) on envd's behalf, for the writable files layers
 * of a filesystem reset (layers.py). Nothing else can reach it: the pair has no name,
 * and envd's end is never inherited by a command.
 *
 * A request is one packet of 1 to MAX_OPS operations back to back, each one
 * 'M' SOURCE \0 TARGET \0 FSTYPE \0 FLAGS \0 DATA \0 (mount) or 'U' TARGET \0 FLAGS \0
 * (umount2); FLAGS in decimal; at most MAX_REQUEST bytes in all. The whole packet is
 * checked first: a malformed one performs nothing. The operations then run in order
 * and the first that fails stops the rest. The answer is eight bytes, two native ints:
 * how many operations succeeded (so the index of the one that failed), and 0 when all
 * did, else that operation's errno (EINVAL with a count of 0 for a malformed packet).
 * A layer's mounts are so one round trip (layers.py). The helper exits when envd's end
 * closes. Its paths resolve in its own root, the sandbox's real one, whatever envd's
 * root is at the time.
 *
 * Built without libc like exec_as.c (x86_64 raw system calls): ~16 KiB of memory. */

#define SYS_read 0
#define SYS_write 1
#define SYS_rt_sigaction 13
#define SYS_exit 60
#define SYS_mount 165
#define SYS_umount2 166

#define EINTR 4
#define EINVAL 22
#define SIGKILL 9
#define SIGSTOP 19
#define SIG_IGN 1
#define FD 3
#define MAX_REQUEST 8192
#define MAX_FIELDS 5
#define MAX_OPS 32

struct sigaction_k { long handler; unsigned long flags; long restorer; unsigned long mask; };

static long sys5(long n, long a, long b, long c, long d, long e) {
    long r;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
                     : "rcx", "r11", "memory");
    return r;
}

static char buf[MAX_REQUEST + 1];

/* A decimal number of at most 19 digits, or -1. */
static long number(const char *s) {
    long v = 0;
    int n = 0;
    if (!*s) return -1;
    for (; *s; s++, n++) {
        if (*s < '0' || *s > '9' || n == 19) return -1;
        v = v * 10 + (*s - '0');
    }
    return v;
}

struct op { char kind; const char *field[MAX_FIELDS]; long flags; };

static struct op ops[MAX_OPS];

/* The packet's operations into ops; their count, or -1 when it is malformed. */
static int parse(long got) {
    long at = 0;
    int n = 0;
    while (at < got) {
        if (n == MAX_OPS) return -1;
        struct op *o = &ops[n++];
        o->kind = buf[at++];
        int want = o->kind == 'M' ? 5 : o->kind == 'U' ? 2 : 0;
        if (!want) return -1;
        /* Fields after the op byte, each ended by a NUL inside the packet. */
        for (int i = 0; i < want; i++) {
            o->field[i] = buf + at;
            while (at < got && buf[at]) at++;
            if (at >= got) return -1;
            at++;
        }
        o->flags = number(o->field[want == 5 ? 3 : 1]);
        if (o->flags < 0) return -1;
    }
    return n;
}

static long perform(const struct op *o) {
    if (o->kind == 'M')
        return sys5(SYS_mount, (long)(*o->field[0] ? o->field[0] : 0), (long)o->field[1],
                    (long)(*o->field[2] ? o->field[2] : 0), o->flags,
                    (long)(*o->field[4] ? o->field[4] : 0));
    return sys5(SYS_umount2, (long)o->field[0], o->flags, 0, 0, 0);
}

/* answer[0]: operations done; answer[1]: 0, or the errno of the one that failed. */
static void handle(long got, int answer[2]) {
    answer[0] = 0;
    answer[1] = EINVAL;
    int n = got > MAX_REQUEST ? -1 : parse(got);
    if (n <= 0) return;
    for (int i = 0; i < n; i++) {
        long r = perform(&ops[i]);
        if (r < 0) {
            answer[0] = i;
            answer[1] = (int)-r;
            return;
        }
    }
    answer[0] = n;
    answer[1] = 0;
}

void cmain(void) {
    /* Signals a command may send (it cannot be asked to mount, but it can be killed,
     * and then the next reset is a full one): the catchable ones are ignored. */
    struct sigaction_k ign = {SIG_IGN, 0, 0, 0};
    for (long sig = 1; sig < 32; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            sys5(SYS_rt_sigaction, sig, (long)&ign, 0, 8, 0);
    for (;;) {
        long got = sys5(SYS_read, FD, (long)buf, MAX_REQUEST + 1, 0, 0);
        if (got == -EINTR) continue;
        if (got <= 0) break; /* envd's end closed (or the pair is gone) */
        int answer[2];
        handle(got, answer);
        sys5(SYS_write, FD, (long)answer, 8, 0, 0);
    }
    sys5(SYS_exit, 0, 0, 0, 0, 0);
    for (;;) {}
}

__asm__(".text\n.global _start\n_start:\n"
        "  xor %rbp, %rbp\n  and $-16, %rsp\n  call cmain\n  hlt\n");
