/* emu-gpu (gpu/emu.c), the backend whose memory is out of the host's reach as a GPU's is: the
 * daemon's tests run through it to prove that shardd never reads or writes device memory on the
 * host, so its own rules are tested here, each against what a GPU would do:
 *   - a read or a write of a device address on the host faults (SIGSEGV);
 *   - a kernel given host memory, and a copy past the end of an allocation, abort naming them;
 *   - copies host -> device -> device -> host keep every byte; zero and reduce_add on device
 *     memory give what a plain loop gives;
 *   - a shared allocation's fd maps, in a client, the very bytes the device holds; a read-only
 *     one (the gather pool) cannot be mapped writable. */
#include "check.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"

#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static const struct sd_gpu_ops *dev;
static struct sd_gpu_queue *q;

/* run f in a child; returns the signal that ended it, 0 for a clean exit */
static int child_signal(void (*f)(void *), void *arg)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        /* the abort's message goes to stderr: keep the test's output to what it checks */
        if (freopen("/dev/null", "w", stderr) == NULL)
            _exit(3);
        /* the kernel's own disposition, not a sanitizer's handler: the fault ends the child */
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(SIGSEGV, &dfl, NULL);
        f(arg);
        _exit(0);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFSIGNALED(st) ? WTERMSIG(st) : 0;
}

static void host_read(void *p)
{
    volatile const uint8_t *b = p;
    _exit(b[0] == 0x5a ? 1 : 2);
}

static void host_write(void *p)
{
    ((volatile uint8_t *)p)[17] = 1;
}

static void kernel_on_host(void *p)
{
    float host_acc[16] = {0};
    dev->reduce_add(q, host_acc, p, SD_DTYPE_FP32, 16);
}

static void copy_past_end(void *p)
{
    static uint8_t src[8192];
    dev->copy(q, p, src, 4097);
}

static void t_faults(void)
{
    struct sd_mem m;
    TH_CHECK(dev->alloc(0, 4096, SD_MEM_PRIVATE, "t", &m) == SD_OK, "alloc");
    TH_CHECK(child_signal(host_read, m.ptr) == SIGSEGV, "a host read of device memory did not "
                                                        "fault");
    TH_CHECK(child_signal(host_write, m.ptr) == SIGSEGV, "a host write of device memory did not "
                                                         "fault");
    TH_CHECK(child_signal(kernel_on_host, m.ptr) == SIGABRT,
             "a kernel given host memory did not abort");
    TH_CHECK(child_signal(copy_past_end, m.ptr) == SIGABRT,
             "a copy past the end of an allocation did not abort");
    dev->free(&m);
    TH_CHECK(m.ptr == NULL && m.fd == -1, "free leaves the descriptor empty");
}

static void t_copies(void)
{
    enum { N = 4099 };
    float in[N], out[N], acc[N];
    for (int i = 0; i < N; i++) {
        in[i] = (float)i * 0.5f - 7.0f;
        acc[i] = 1.0f + (float)i;
    }
    struct sd_mem a, b;
    TH_CHECK(dev->alloc(0, N * sizeof(float), SD_MEM_PRIVATE, "a", &a) == SD_OK, "alloc a");
    TH_CHECK(dev->alloc(0, N * sizeof(float), SD_MEM_PRIVATE, "b", &b) == SD_OK, "alloc b");
    dev->copy(q, a.ptr, in, sizeof(in));    /* host -> device */
    dev->copy(q, b.ptr, a.ptr, sizeof(in)); /* device -> device */
    dev->copy(q, out, b.ptr, sizeof(out));  /* device -> host */
    TH_CHECK(dev->sync(q) == SD_OK && memcmp(in, out, sizeof(in)) == 0, "copies changed bytes");
    dev->copy(q, b.ptr, acc, sizeof(acc));
    dev->reduce_add(q, b.ptr, a.ptr, SD_DTYPE_FP32, N);
    dev->copy(q, out, b.ptr, sizeof(out));
    int bad = 0;
    for (int i = 0; i < N; i++)
        bad += out[i] != acc[i] + in[i];
    TH_CHECK(dev->sync(q) == SD_OK && bad == 0, "reduce_add: %d of %d sums wrong", bad, N);
    dev->zero(q, (float *)a.ptr + 1, (N - 2) * sizeof(float));
    dev->copy(q, out, a.ptr, sizeof(out));
    bad = out[0] != in[0] || out[N - 1] != in[N - 1];
    for (int i = 1; i < N - 1; i++)
        bad += out[i] != 0.0f;
    TH_CHECK(bad == 0, "zero: %d elements wrong (or outside its range)", bad);
    dev->free(&a);
    dev->free(&b);
}

static void t_shared(void)
{
    struct sd_mem m, ro;
    uint8_t in[8192], out[8192];
    for (size_t i = 0; i < sizeof(in); i++)
        in[i] = (uint8_t)(i * 7 + 3);
    TH_CHECK(dev->alloc(0, sizeof(in), SD_MEM_SHARED, "s", &m) == SD_OK && m.fd >= 0, "shared");
    uint8_t *client = mmap(NULL, sizeof(in), PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
    TH_CHECK(client != MAP_FAILED, "a client maps the shared allocation's fd");
    if (client == MAP_FAILED)
        return;
    dev->copy(q, m.ptr, in, sizeof(in));
    TH_CHECK(memcmp(client, in, sizeof(in)) == 0, "the client does not see the device's bytes");
    memset(client + 100, 0xee, 50); /* the trainer writes a gradient */
    dev->copy(q, out, m.ptr, sizeof(out));
    TH_CHECK(out[99] == in[99] && out[100] == 0xee && out[149] == 0xee && out[150] == in[150],
             "the device does not see the client's bytes");
    munmap(client, sizeof(in));
    dev->free(&m);

    TH_CHECK(dev->alloc(0, 4096, SD_MEM_SHARED | SD_MEM_CLIENT_RO, "ro", &ro) == SD_OK, "ro");
    void *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, ro.fd, 0);
    TH_CHECK(w == MAP_FAILED, "the read-only allocation mapped writable in a client");
    if (w != MAP_FAILED)
        munmap(w, 4096);
    dev->free(&ro);
}

int main(void)
{
    dev = sd_gpu_find("emu-gpu");
    TH_CHECK(dev != NULL && !dev->host_visible && !dev->host_memory, "emu-gpu is built in");
    if (dev == NULL || dev->queue_create(&q) != SD_OK)
        return th_summary("test_emu_gpu");
    t_faults();
    t_copies();
    t_shared();
    dev->queue_destroy(q);
    return th_summary("test_emu_gpu");
}
