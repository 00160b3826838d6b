/* envd-stub FDS CMD [ARG...]: what the sandbox's pid 1 runs while envd is dormant.
 *
 * envd, idle, executes this in its own place (dormancy.py): pid 1 stays pid 1, its
 * listening sockets (FDS, comma-separated descriptor numbers, inherited) stay open,
 * and the ~20 MiB of a Python process go back to the host. The stub reaps every child
 * (it is init: SIGCHLD through a signalfd, no handler), answers nothing, and the
 * moment a listener has a connection waiting (not accepted: it stays in the backlog)
 * it executes CMD with the same descriptors, so envd serves that connection itself,
 * with no refusal and no reset. It waits in poll(2) with no timeout: no CPU at all
 * while nothing comes (poll, not epoll, keeps nothing a gVisor restore could lose).
 *
 * Built without libc like exec_as.c (x86_64 raw system calls): ~16 KiB of memory. */

#define SYS_read 0
#define SYS_write 1
#define SYS_close 3
#define SYS_poll 7
#define SYS_rt_sigaction 13
#define SYS_rt_sigprocmask 14
#define SYS_nanosleep 35
#define SYS_execve 59
#define SYS_exit 60
#define SYS_wait4 61
#define SYS_signalfd4 289

#define EINTR 4
#define SIGKILL 9
#define SIGCHLD 17
#define SIGSTOP 19
#define SIG_IGN 1
#define SIG_BLOCK 0
#define SIG_UNBLOCK 1
#define WNOHANG 1
#define POLLIN 1
#define SFD_NONBLOCK 04000
#define SFD_CLOEXEC 02000000
#define MAX_LISTENERS 8

struct pollfd { int fd; short events; short revents; };
struct timespec { long sec; long nsec; };
struct sigaction_k { long handler; unsigned long flags; long restorer; unsigned long mask; };

static long sys4(long n, long a, long b, long c, long d) {
    long r;
    register long r10 __asm__("r10") = d;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10)
                     : "rcx", "r11", "memory");
    return r;
}

static unsigned long len(const char *s) {
    unsigned long n = 0;
    while (s[n]) n++;
    return n;
}

static void say(const char *s) { sys4(SYS_write, 2, (long)s, (long)len(s), 0); }

static void fail(const char *why) {
    say("envd-stub: "); say(why); say("\n");
    sys4(SYS_exit, 1, 0, 0, 0);
    for (;;) {}
}

static void reap(void) {
    while (sys4(SYS_wait4, -1, 0, WNOHANG, 0) > 0) {}
}

void cmain(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    if (argc < 3) fail("usage: envd-stub FD[,FD...] CMD [ARG...]");

    struct pollfd fds[MAX_LISTENERS + 1];
    int n = 0;
    for (const char *p = argv[1]; *p;) {
        long v = 0;
        if (*p < '0' || *p > '9') fail("bad descriptor list");
        while (*p >= '0' && *p <= '9' && v < 65536) v = v * 10 + (*p++ - '0');
        if (n == MAX_LISTENERS || v >= 65536) fail("bad descriptor list");
        fds[n].fd = (int)v;
        fds[n].events = POLLIN;
        n++;
        if (*p == ',') p++;
        else if (*p) fail("bad descriptor list");
    }
    if (n == 0) fail("no descriptors");

    /* gVisor delivers a signal sent from the host (`runsc kill`: the node's memory
     * pressure SIGUSR2) to init even with no handler: its default action would end the
     * sandbox. Ignored instead (envd restores the dispositions when woken). */
    struct sigaction_k ign = {SIG_IGN, 0, 0, 0};
    for (long sig = 1; sig < 32; sig++)
        if (sig != SIGKILL && sig != SIGSTOP && sig != SIGCHLD)
            sys4(SYS_rt_sigaction, sig, (long)&ign, 0, 8);

    unsigned long chld = 1UL << (SIGCHLD - 1);
    if (sys4(SYS_rt_sigprocmask, SIG_BLOCK, (long)&chld, 0, 8) < 0) fail("sigprocmask");
    long sfd = sys4(SYS_signalfd4, -1, (long)&chld, 8, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0) fail("signalfd");
    fds[n].fd = (int)sfd;
    fds[n].events = POLLIN;
    reap(); /* whatever exited while envd handed over */
    /* The host reads this (runtime.envd_dormant): envd's memory is gone by now. */
    say("envd dormant (envd-stub holds its port)\n");

    for (;;) {
        long r = sys4(SYS_poll, (long)fds, n + 1, -1, 0);
        if (r == -EINTR) continue;
        if (r < 0) break; /* cannot wait: wake envd rather than spin */
        if (fds[n].revents) {
            char buf[128 * 8]; /* signalfd_siginfo is 128 bytes */
            while (sys4(SYS_read, sfd, (long)buf, sizeof buf, 0) > 0) {}
            reap();
        }
        int wake = 0;
        for (int i = 0; i < n; i++) wake |= fds[i].revents != 0;
        if (wake) break;
    }

    /* envd gets init's usual signal state back (a blocked SIGCHLD would stay blocked). */
    sys4(SYS_close, sfd, 0, 0, 0);
    sys4(SYS_rt_sigprocmask, SIG_UNBLOCK, (long)&chld, 0, 8);
    for (;;) {
        sys4(SYS_execve, (long)argv[2], (long)(argv + 2), (long)envp, 0);
        /* pid 1 must not exit (the sandbox would end): the connection waits, retry. */
        say("envd-stub: cannot execute envd; retrying in 1 s\n");
        struct timespec ts = {1, 0};
        sys4(SYS_nanosleep, (long)&ts, 0, 0, 0);
        reap();
    }
}

__asm__(".text\n.global _start\n_start:\n"
        "  xor %rbp, %rbp\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call cmain\n  hlt\n");
